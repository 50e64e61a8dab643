"""Several runs of one experiment (variants × seeds): run or collect them, aggregate, tabulate, plot.

The ablations and Table 1 are suites. A run lives in ``<out_dir>/<variant>/seed<k>``; a run whose
``summary.json`` exists is collected as it is, a run with a ``config.json`` but no summary (stopped
or killed) is resumed from its checkpoint, anything else is started. Runs go one at a time, so a
suite can be stopped and started again at any point without losing finished work.

Aggregation is over seeds: the mean and the standard error (sample std / sqrt(n); none for n = 1)
of success@k and payoff@k of the experiment's headline split, for every episode index k.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from experiments.common import ConfigErrorParser, split_dotted
from experiments.presets import EnvExperiment
from mage_jax import config as C
from mage_jax.evaluation.evaluator import EvalProtocol
from mage_jax.evaluation.plots import _pyplot
from mage_jax.evaluation.report import load_summary


@dataclasses.dataclass(frozen=True)
class Variant:
    """One arm of a suite: config overrides and changes of the evaluation options."""

    name: str
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    protocol: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Fields of the environment's ``EvalProtocol`` to replace (e.g. ``{"eval_pool": {...}}``)."""
    trains: bool = True
    label: str = ""


@dataclasses.dataclass
class RunRecord:
    variant: str
    seed: int
    run_dir: str
    summary: dict[str, Any] | None
    status: str
    """``collected`` (finished earlier), ``ran`` (finished now), ``missing`` (collect-only) or ``failed``."""


def run_dir_of(out_dir: str, variant: str, seed: int) -> str:
    return os.path.join(out_dir, variant, f"seed{seed}")


def variant_config(env: EnvExperiment, variant: Variant, preset: str, seed: int, run_dir: str,
                   overrides: Mapping[str, Any], *, check_paths: bool = True) -> C.ExperimentConfig:
    """Preset, then the variant, then the command line's overrides; the seed and run dir last."""
    merged = {**variant.overrides, **overrides, "train.seed": seed, "model.init_seed": seed,
              "logging.run_dir": run_dir}
    return env.config(preset, merged, check_paths=check_paths,
                      experiment=f"{env.name}_{variant.name}")


def variant_protocol(env: EnvExperiment, variant: Variant, cfg: C.ExperimentConfig) -> EvalProtocol:
    return dataclasses.replace(env.protocol(cfg), **dict(variant.protocol))


def run_suite(env: EnvExperiment, variants: Sequence[Variant], *, preset: str, seeds: Sequence[int],
              out_dir: str, overrides: Mapping[str, Any] | None = None, collect_only: bool = False,
              log: Callable[[str], None] = print) -> list[RunRecord]:
    """Run (or collect) every variant × seed, one at a time."""
    overrides = dict(overrides or {})
    records = []
    for variant in variants:
        for seed in seeds:
            run_dir = run_dir_of(out_dir, variant.name, seed)
            summary = load_summary(run_dir)
            if summary is not None:
                records.append(RunRecord(variant.name, seed, run_dir, summary, "collected"))
                continue
            if collect_only:
                records.append(RunRecord(variant.name, seed, run_dir, None, "missing"))
                continue
            cfg = variant_config(env, variant, preset, seed, run_dir, overrides)
            protocol = variant_protocol(env, variant, cfg)
            resume = os.path.isfile(os.path.join(run_dir, C.CONFIG_FILE))
            if resume:
                saved = C.load(run_dir)
                if C.to_dict(saved) != C.to_dict(cfg):
                    raise C.ConfigError(f"{run_dir} holds an unfinished run with another config; "
                                        "remove it or choose another --out-dir")
            log(f"[suite] {variant.name} seed {seed}: {'resuming' if resume else 'running'} in {run_dir}")
            start = time.perf_counter()
            outcome = env.run(cfg, resume=resume, trains=variant.trains, protocol=protocol)
            if outcome.status != "finished":
                records.append(RunRecord(variant.name, seed, run_dir, None, "failed"))
                log(f"[suite] {variant.name} seed {seed}: stopped ({outcome.status})")
                return records
            summary = load_summary(run_dir)
            log(f"[suite] {variant.name} seed {seed}: done in {time.perf_counter() - start:.0f} s")
            records.append(RunRecord(variant.name, seed, run_dir, summary, "ran"))
    return records


# ----------------------------------------------------------------------------------------------
# aggregation


def _mean_se(values: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Mean over axis 0 and the standard error (None with one value)."""
    mean = values.mean(axis=0)
    if len(values) < 2:
        return mean, None
    return mean, values.std(axis=0, ddof=1) / np.sqrt(len(values))


@dataclasses.dataclass
class Aggregate:
    variant: str
    seeds: list[int]
    split: str
    success: np.ndarray
    success_se: np.ndarray | None
    payoff: np.ndarray
    payoff_se: np.ndarray | None
    draw: np.ndarray
    wall_seconds: float
    iterations: int
    by_opponent_payoff: dict[str, tuple[float, float | None]]
    reference: dict[str, Any] | None
    per_seed: dict[int, tuple[float, float, float]] = dataclasses.field(default_factory=dict)
    """seed -> (final success, first-episode payoff, final payoff): tiny runs are often bimodal."""


def aggregate(records: Sequence[RunRecord], split: str) -> dict[str, Aggregate]:
    """Per variant: mean ± SE over seeds of the curves of ``split`` (variants in record order)."""
    out: dict[str, Aggregate] = {}
    by_variant: dict[str, list[RunRecord]] = {}
    for r in records:
        if r.summary is not None:
            by_variant.setdefault(r.variant, []).append(r)
    for name, recs in by_variant.items():
        blocks = [r.summary["evaluation"].get(split) for r in recs]
        recs = [r for r, b in zip(recs, blocks) if b is not None]
        blocks = [b for b in blocks if b is not None]
        if not blocks:
            continue
        curves = [b["metrics"]["curves"] for b in blocks]

        def stack(key: str, curves: list[Any] = curves) -> np.ndarray:
            return np.asarray([c[key] for c in curves], dtype=np.float64)

        success, success_se = _mean_se(stack("success"))
        payoff, payoff_se = _mean_se(stack("payoff"))
        opponents: dict[str, tuple[float, float | None]] = {}
        for opp in blocks[0]["metrics"].get("by_opponent", {}):
            vals = np.asarray([b["metrics"]["by_opponent"][opp]["curves"]["payoff"][-1] for b in blocks
                               if opp in b["metrics"].get("by_opponent", {})])
            m, se = _mean_se(vals[:, None])
            opponents[opp] = (float(m[0]), None if se is None else float(se[0]))
        out[name] = Aggregate(
            variant=name, seeds=[r.seed for r in recs], split=split, success=success, success_se=success_se,
            payoff=payoff, payoff_se=payoff_se, draw=stack("draw").mean(axis=0),
            wall_seconds=float(np.mean([r.summary.get("wall_seconds", 0.0) for r in recs])),
            iterations=int(recs[0].summary.get("iterations", 0)), by_opponent_payoff=opponents,
            reference=blocks[0].get("reference"),
            per_seed={r.seed: (float(c["success"][-1]), float(c["payoff"][0]), float(c["payoff"][-1]))
                      for r, c in zip(recs, curves)},
        )
    return out


def _pm(mean: float, se: float | None, signed: bool = False) -> str:
    text = f"{mean:+.3f}" if signed else f"{mean:.3f}"
    return text if se is None else f"{text} ± {se:.3f}"


def markdown_table(aggregates: Mapping[str, Aggregate], *, paper: Mapping[str, str] | None = None,
                   title: str = "", labels: Mapping[str, str] | None = None) -> str:
    """success@k and payoff@k (mean ± SE over seeds) per variant, the paper's number, the references."""
    if not aggregates:
        return f"{title}\n\n(no finished runs)\n" if title else "(no finished runs)\n"
    first = next(iter(aggregates.values()))
    K = len(first.success)
    head = (["variant", "seeds"] + [f"success@{k + 1}" for k in range(K)]
            + [f"payoff@{k + 1}" for k in range(K)] + ["paper", "iters", "wall s/run"])
    lines = ([f"**{title}**", ""] if title else []) + [
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, a in aggregates.items():
        cells = [(labels or {}).get(name, name), str(len(a.seeds))]
        cells += [_pm(a.success[k], None if a.success_se is None else a.success_se[k]) for k in range(K)]
        cells += [_pm(a.payoff[k], None if a.payoff_se is None else a.payoff_se[k], True) for k in range(K)]
        cells += [(paper or {}).get(name, "–"), str(a.iterations), f"{a.wall_seconds:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    ref = first.reference or {}
    for label, s_key, p_key in (("random policy (same meta-episodes)", "random_success", "random_payoff"),
                                ("best fixed strategy by payoff", "best_fixed_success", "best_fixed_payoff"),
                                ("adaptive bound (oracle)", None, "adaptive_payoff_bound")):
        if p_key not in ref and (s_key is None or s_key not in ref):
            continue
        cells = [f"*{label}*", ""]
        cells += [f"{ref[s_key][k]:.3f}" if s_key in ref else "" for k in range(K)]
        cells += [f"{ref[p_key][k]:+.3f}" if p_key in ref else "" for k in range(K)]
        lines.append("| " + " | ".join(cells + ["", "", ""]) + " |")
    if "winnable" in ref:
        lines.append(f"| *winnable share (success ceiling)* | | {ref['winnable']:.3f} |" + " |" * (2 * K + 1))
    opponents = sorted({o for a in aggregates.values() for o in a.by_opponent_payoff})
    if opponents:
        lines += ["", f"final-episode payoff by opponent (episode {K}):", "",
                  "| variant | " + " | ".join(opponents) + " |", "|" + "---|" * (len(opponents) + 1)]
        for name, a in aggregates.items():
            cells = [_pm(*a.by_opponent_payoff[o], signed=True) if o in a.by_opponent_payoff else "–"
                     for o in opponents]
            lines.append(f"| {(labels or {}).get(name, name)} | " + " | ".join(cells) + " |")
    seeds = sorted({seed for a in aggregates.values() for seed in a.per_seed})
    if len(seeds) > 1:
        lines += ["", f"per seed: success@{K}, payoff@1 → payoff@{K}:", "",
                  "| variant | " + " | ".join(f"seed {seed}" for seed in seeds) + " |",
                  "|" + "---|" * (len(seeds) + 1)]
        for name, a in aggregates.items():
            cells = [(f"{a.per_seed[seed][0]:.3f}, {a.per_seed[seed][1]:+.3f} → {a.per_seed[seed][2]:+.3f}"
                      if seed in a.per_seed else "–") for seed in seeds]
            lines.append(f"| {(labels or {}).get(name, name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_aggregates(aggregates: Mapping[str, Aggregate], path: str, *, title: str = "",
                    labels: Mapping[str, str] | None = None) -> str:
    """Two panels (success@k, payoff@k against the episode), one line per variant with SE bars."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    ref = next(iter(aggregates.values())).reference or {} if aggregates else {}
    for ax, metric in zip(axes, ("success", "payoff")):
        for name, a in aggregates.items():
            y = getattr(a, metric)
            se = getattr(a, f"{metric}_se")
            x = np.arange(1, len(y) + 1)
            ax.errorbar(x, y, yerr=se, marker="o", capsize=3, label=(labels or {}).get(name, name))
        key = f"random_{metric}"
        if key in ref:
            ax.plot(np.arange(1, len(ref[key]) + 1), ref[key], "k--", linewidth=1, label="random policy")
        if metric == "payoff" and "best_fixed_payoff" in ref:
            ax.plot(np.arange(1, len(ref["best_fixed_payoff"]) + 1), ref["best_fixed_payoff"], "k:",
                    linewidth=1, label="best fixed")
        if metric == "success" and "winnable" in ref:
            ax.axhline(ref["winnable"], color="gray", linewidth=1, linestyle="-.", label="winnable")
        ax.set_xlabel("episode")
        ax.set_ylabel(f"{metric}@k")
        ax.set_xticks(np.arange(1, len(next(iter(aggregates.values())).success) + 1) if aggregates else [])
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# command line of suites


def suite_parser(prog: str, description: str, *, variants: Sequence[str], envs: Sequence[str],
                 default_env: str) -> argparse.ArgumentParser:
    p = ConfigErrorParser(prog=prog, description=description, allow_abbrev=False)
    p.add_argument("--env", default=default_env, choices=list(envs))
    p.add_argument("--preset", default="tiny", help="tiny (CPU), small or paper (need --model-path)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: 0,1,2 tiny; 0 otherwise)")
    p.add_argument("--variants", default=",".join(variants), help=f"subset of {','.join(variants)}")
    p.add_argument("--out-dir", "--out", dest="out_dir", default=None,
                   help="where the runs go (default runs/<suite>/<env>)")
    p.add_argument("--figure", default=None, help="also write the plot here (e.g. docs/figures/x.png)")
    p.add_argument("--model-path", default=None, help="local Hugging Face folder (= --model.path)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--collect-only", action="store_true", help="tabulate finished runs, start nothing")
    return p


@dataclasses.dataclass
class SuiteArgs:
    env: str
    preset: str
    seeds: list[int]
    variants: list[str]
    out_dir: str
    figure: str | None
    overrides: dict[str, Any]
    collect_only: bool


def parse_suite_args(argv: Sequence[str] | None, *, name: str, description: str, variants: Sequence[str],
                     envs: Sequence[str], default_env: str) -> SuiteArgs:
    """Parse a suite command line; every problem is one ConfigError."""
    argv = list(sys.argv[1:] if argv is None else argv)
    dotted, rest = split_dotted(argv)
    parser = suite_parser(f"python -m experiments.{name}", description, variants=variants, envs=envs,
                          default_env=default_env)
    args = parser.parse_args(rest)
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in variants]
    if unknown or not chosen:
        raise C.ConfigError(f"--variants must name some of {', '.join(variants)} (got {args.variants!r})")
    try:
        seeds = ([int(s) for s in args.seeds.split(",") if s.strip()] if args.seeds is not None
                 else ([0, 1, 2] if args.preset == "tiny" else [0]))
    except ValueError:
        raise C.ConfigError(f"--seeds must be comma-separated integers (got {args.seeds!r})") from None
    if not seeds:
        raise C.ConfigError("--seeds must name at least one seed")
    overrides: dict[str, Any] = dict(C.parse_assignment(s) for s in args.sets)
    overrides.update(dict(dotted))
    if args.model_path is not None:
        overrides["model.path"] = args.model_path
    return SuiteArgs(env=args.env, preset=args.preset, seeds=seeds, variants=chosen,
                     out_dir=args.out_dir or os.path.join("runs", name.replace(".", "/"), args.env),
                     figure=args.figure, overrides=overrides, collect_only=bool(args.collect_only))
