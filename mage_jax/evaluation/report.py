"""What a finished run reports: ``summary.json``, the evaluation records in the metrics log, the plots
and the results table. Every entry point (training, evaluation-only, checkpoint evaluation) writes
through these functions, so a summary has one format and is always written atomically.

``summary.json``::

    {"experiment", "status", "iterations", "wall_seconds", "setup_seconds", "run_dir",
     "compile": {"programs", "seconds", "cache_hits"} (the whole run: mage_jax.compile_report),
     "model": {"num_params", "vocab_size", "num_layers", "hidden_size"},
     "evaluation": {split: {"metrics": compute_metrics(...), "reference": {...} or null}}, ...}
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from mage_jax.compile_report import CompileReport
from mage_jax.evaluation import plots
from mage_jax.evaluation.evaluator import SplitResult
from mage_jax.evaluation.metrics import flatten_metrics
from mage_jax.evaluation.samples import render_markdown
from mage_jax.logging import METRICS_FILE, MetricsLogger, read_jsonl, to_jsonable

SUMMARY_FILE = "summary.json"
DIAGNOSTIC_PLOT_KEYS = ("payoff@last", "entropy_play@1", "entropy_play@last", "private_dependence",
                        "dependent_share")
"""``plots/diagnostics.png``: what the policy's decisions depend on (``evaluation.decisions``), then the
final-episode payoff per opponent of the training rollouts."""
TRAINING_PLOT_KEYS = ("success@last", "payoff@last", "reward_mean", "policy_loss", "entropy", "approx_kl",
                      "grad_norm", "clip_fraction", "iteration_seconds")


def log_evaluation(logger: MetricsLogger, iteration: int, results: Mapping[str, SplitResult]) -> None:
    """One metrics-log record per split (flat keys such as ``success@3``, ``opponent/cfr/payoff@1``;
    episodes counted from 1)."""
    for split, block in results.items():
        logger.log(iteration, flatten_metrics(block.metrics), split=split)
        if block.samples:
            logger.log_samples(iteration, block.samples, split=split, text=render_markdown(block.samples))


def build_summary(*, experiment: str, iterations: int, run_dir: str, model_config: Any,
                  results: Mapping[str, SplitResult], wall_seconds: float, setup_seconds: float | None = None,
                  compiled: CompileReport | None = None, **extra: Any) -> dict[str, Any]:
    """The JSON-ready summary of a finished run (plain values only); ``compiled``: the XLA programs of
    the whole run (``compile``)."""
    summary: dict[str, Any] = {
        "experiment": experiment,
        "status": "finished",
        "iterations": int(iterations),
        "wall_seconds": float(wall_seconds),
    }
    if setup_seconds is not None:
        summary["setup_seconds"] = float(setup_seconds)
    summary["run_dir"] = os.path.abspath(run_dir)
    if compiled is not None:
        summary["compile"] = dataclasses.asdict(compiled)
    summary.update(extra)
    summary["model"] = {"num_params": int(model_config.num_params()),
                        "vocab_size": int(model_config.vocab_size),
                        "num_layers": int(model_config.num_layers),
                        "hidden_size": int(model_config.hidden_size)}
    summary["evaluation"] = {split: {"metrics": block.metrics, "reference": block.reference}
                             for split, block in results.items()}
    return to_jsonable(summary)


def write_summary(run_dir: str, summary: Mapping[str, Any]) -> str:
    """Write ``<run_dir>/summary.json`` atomically; returns its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, SUMMARY_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(to_jsonable(summary), f, indent=1)
    os.replace(path + ".tmp", path)
    return path


def load_summary(run_dir: str) -> dict[str, Any] | None:
    """The summary of a finished run, or None when the run has none."""
    path = os.path.join(run_dir, SUMMARY_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------
# plots


REFERENCE_LINES = {
    "success": (("winnable", "ceiling (winnable)"), ("random_success", "random"),
                ("best_fixed_by_success_success", "best fixed by wins")),
    "payoff": (("random_payoff", "random"), ("best_fixed_payoff", "best fixed by payoff"),
               ("adaptive_payoff_bound", "adaptive bound")),
}
"""The reference lines of the success and payoff plots: (reference key, legend name). The best fixed
strategies are the table's: by wins on success (its ``fix:win`` column), by payoff on payoff (``fix:pay``)."""
GROUP_REFERENCE_LINES = {"success": (("winnable", "ceiling"),)}
"""Per-opponent reference lines, drawn in the opponent's colour where a split has several opponents."""


def reference_lines(ref: Mapping[str, Any], names: Mapping[str, Sequence[tuple[str, str]]]
                    ) -> dict[str, dict[str, Any]]:
    """``{metric: {legend name: value}}`` of the reference keys in ``ref`` (``REFERENCE_LINES``)."""
    return {metric: {label: ref[key] for key, label in pairs if key in ref}
            for metric, pairs in names.items()}


def write_plots(run_dir: str, results: Mapping[str, SplitResult], *,
                selection: plots.Selection | None = None) -> list[str]:
    """PNGs in ``<run_dir>/plots``: success@k and payoff@k per opponent (with the reference lines) for
    every evaluation split, and the training curves (``selection``: the final evaluation measured the
    state of an earlier iteration, where its points are drawn)."""
    out = os.path.join(run_dir, "plots")
    os.makedirs(out, exist_ok=True)
    written = []
    for split, block in results.items():
        ref = block.reference or {}
        per_opponent = ref.get("by_opponent") or {}
        group: dict[str, dict[str, dict[str, Any]]] = {}
        if len(block.metrics.get("by_opponent") or {}) > 1:
            for name, sub in per_opponent.items():
                for metric, lines in reference_lines(sub, GROUP_REFERENCE_LINES).items():
                    if lines:
                        group.setdefault(metric, {})[name] = lines
        written += [str(p) for p in plots.plot_success_and_payoff(
            block.metrics, out, reference=reference_lines(ref, REFERENCE_LINES), prefix=f"{split}_",
            group_reference=group)]
    metrics_file = os.path.join(run_dir, METRICS_FILE)
    with contextlib.suppress(ValueError):  # no training record (zero iterations)
        written.append(str(plots.plot_training_curves(metrics_file, os.path.join(out, "training.png"),
                                                      keys=TRAINING_PLOT_KEYS, selection=selection)))
    with contextlib.suppress(ValueError, FileNotFoundError):  # no diagnostics logged
        per_opponent_keys = sorted({k for r in read_jsonl(run_dir) for k in r
                                    if k.startswith("payoff@last/")})
        written.append(str(plots.plot_training_curves(metrics_file, os.path.join(out, "diagnostics.png"),
                                                      keys=DIAGNOSTIC_PLOT_KEYS + tuple(per_opponent_keys),
                                                      selection=selection)))
    return written


# ----------------------------------------------------------------------------------------------
# the results table


def _fmt(x: Any, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def _fmt_se(x: Any, se: Any, signed: bool = False) -> str:
    """``0.340±0.030`` (the mean and its standard error; the mean alone when there is no error)."""
    return _fmt(x, signed) if se is None else f"{_fmt(x, signed)}±{se:.3f}"


def gain_line(name: str, block: Mapping[str, Any]) -> str | None:
    """The paired payoff gain of a metrics block in words, with its standard error and z = mean / SE."""
    gain = block.get("payoff_gain")
    if not gain or gain["last"] == gain["first"]:
        return None
    mean, se = gain["mean"], gain["standard_error"]
    z = "" if not se else f" ({mean / se:+.1f} SE)"
    spread = "" if se is None else f" ± {se:.3f}"
    difference = f"payoff@{gain['last']} - payoff@{gain['first']}"
    return (f"  gain, {name}: {difference} = {mean:+.3f}{spread}{z}, paired over "
            f"{block['num_meta_episodes']} meta-episodes")


def _fmt_ratio(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


ORACLE_LEGEND = (
    "ceiling = winnable share; fix:win = success of the best pure non-adaptive strategy by wins, fix:pay = "
    "payoff of the best one by payoff; bound = best adaptive payoff (oracle). Payoff in chips.\n"
    "All references are exact oracle values on the same meta-episodes; on a per-opponent row the best "
    "fixed strategy is the best one against that opponent alone (it knows the opponent)."
)


def results_table(summary: Mapping[str, Any], titles: Mapping[str, str] | None = None) -> str:
    """success@k, draw@k and payoff@k per split and opponent, next to the reference policies: random
    (every environment with a reference) and, where the oracle gives them, the winnable ceiling, the best
    fixed strategy and the adaptive payoff bound."""
    lines: list[str] = []
    titles = titles or {}
    oracle = False
    for split, block in summary.get("evaluation", {}).items():
        metrics, ref = block["metrics"], block.get("reference") or {}
        oracle = oracle or "winnable" in ref
        lines.append(f"== {titles.get(split, split)}: {metrics['num_meta_episodes']} meta-episodes ==")
        groups = [("all", metrics, ref)]
        if len(metrics.get("by_opponent", {})) > 1:
            for name, sub in metrics["by_opponent"].items():
                groups.append((name, sub, (ref.get("by_opponent") or {}).get(name) or {}))
        lines.append(f"{'opponent':<14}{'k':>2}  {'success±se':>13}{'draw':>8}{'payoff±se':>15}"
                     f"{'valid':>7}   |  "
                     f"reference: {'rnd succ':>8}{'ceiling':>8}{'fix:win':>8}"
                     f"{'rnd pay':>9}{'fix:pay':>9}{'bound':>9}")
        for name, sub, r in groups:
            curves, errors = sub["curves"], sub.get("standard_errors") or {}
            for k in range(metrics["num_episodes"]):
                def at(key: str, k: int = k, r: Mapping[str, Any] = r) -> Any:
                    v = r.get(key)
                    return None if v is None else (v[k] if isinstance(v, (list, tuple)) else v)

                def se(curve: str, k: int = k, errors: Mapping[str, Any] = errors) -> Any:
                    return (errors.get(curve) or [None] * (k + 1))[k]

                lines.append(
                    f"{name:<14}{k + 1:>2}  {_fmt_se(curves['success'][k], se('success')):>13}"
                    f"{_fmt(curves['draw'][k]):>8}{_fmt_se(curves['payoff'][k], se('payoff'), True):>15}"
                    f"{_fmt_ratio(sub.get('valid_action_ratio')):>7}"
                    f"   |  {'':>11}"
                    f"{_fmt(at('random_success')):>8}{_fmt(at('winnable')):>8}"
                    f"{_fmt(at('best_fixed_by_success_success')):>8}{_fmt(at('random_payoff'), True):>9}"
                    f"{_fmt(at('best_fixed_payoff'), True):>9}{_fmt(at('adaptive_payoff_bound'), True):>9}")
        lines += [line for line in (gain_line(name, sub) for name, sub, _ in groups) if line]
    lines.append("± se = standard error over the meta-episodes; valid = share of the model's actions that "
                 "were legal (timed-out episodes score 0, so read payoff next to it)")
    if oracle:
        lines.append(ORACLE_LEGEND)
    if "wall_seconds" in summary:
        lines.append(f"wall time {summary['wall_seconds']:.0f} s, {summary.get('iterations')} iterations, "
                     f"run dir {summary.get('run_dir')}")
    if "compile" in summary:
        lines.append(CompileReport(**summary["compile"]).describe())
    return "\n".join(lines)
