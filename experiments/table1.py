"""The paper's Table 1 (methods × environments): ``python -m experiments.table1``.

Runs (or collects the finished runs of) every method of ``experiments.baselines`` on every chosen
environment, at one preset, over one or more seeds, and writes to ``--out-dir``:

* ``table.md`` — final-episode success on each environment's headline split (mean ± SE over seeds)
  next to the paper's number; then, per environment, success@k and payoff@k for every episode index
  with the reference policies (random / best fixed / oracle where the environment has them), the
  final payoff per opponent, and the held-out splits (e.g. Tic-Tac-Toe vs MCTS-1000: draw rate);
* ``table1_<env>.png`` — success@k and payoff@k against the episode, one line per method
  (also copied to ``--figures-dir`` when given).

Runs live in ``<out-dir>/<env>/<method>/seed<k>``; finished ones are collected, unfinished ones
resumed, so the command can be stopped and repeated.

    python -m experiments.table1 --envs kuhn_poker,tic_tac_toe --seeds 0        # tiny, CPU
    python -m experiments.table1 --collect-only --out-dir runs/table1           # tabulate only
    python -m experiments.table1 --preset paper --model-path /models/Qwen3-4B --envs alfworld
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from experiments.baselines import METHODS, PAPER_TABLE1
from experiments.common import ConfigErrorParser, run_command, split_dotted
from experiments.environments import ENVIRONMENTS, environment
from experiments.suite import (
    Aggregate,
    RunRecord,
    Variant,
    aggregate,
    markdown_table,
    plot_aggregates,
    run_suite,
    variant_config,
)
from mage_jax import config as C

DEFAULT_ENVS = ("kuhn_poker", "tic_tac_toe")


def method_variants(methods: Sequence[str]) -> list[Variant]:
    return [Variant(m, dict(METHODS[m].overrides), {"eval_mode": METHODS[m].eval_mode},
                    trains=METHODS[m].trains, label=m) for m in methods]


def _csv(text: str, known: Sequence[str], flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in known]
    if bad or not items:
        raise C.ConfigError(f"{flag} must name some of {', '.join(known)} (got {text!r})")
    return items


def _pm(mean: float, se: float | None) -> str:
    return f"{mean:.3f}" if se is None else f"{mean:.3f} ± {se:.3f}"


def overview_table(results: Mapping[str, Mapping[str, Aggregate]], methods: Sequence[str]) -> str:
    """Rows: methods; columns: environments; cells: final-episode success (ours) and the paper's."""
    envs = list(results)
    lines = ["| method | " + " | ".join(f"{e} (ours)" + f" | {e} (paper)" for e in envs) + " |",
             "|" + "---|" * (2 * len(envs) + 1)]
    for m in methods:
        cells = []
        for e in envs:
            a = results[e].get(m)
            cells.append("not run" if a is None else _pm(a.success[-1], None if a.success_se is None
                                                            else a.success_se[-1]))
            paper = PAPER_TABLE1.get(m, {}).get(e)
            cells.append("–" if paper is None else f"{paper:.3f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def heldout_table(records: Sequence[RunRecord], headline: str) -> str:
    """Final-episode success and draw rate of every other split, first and last episode, per method."""
    rows = []
    for r in records:
        if r.summary is None:
            continue
        for split, block in r.summary["evaluation"].items():
            if split == headline:
                continue
            c = block["metrics"]["curves"]
            rows.append(f"| {r.variant} | {r.seed} | {split} | {c['success'][0]:.3f} | "
                        f"{c['success'][-1]:.3f} | {c['draw'][0]:.3f} | {c['draw'][-1]:.3f} | "
                        f"{c['payoff'][-1]:+.3f} |")
    if not rows:
        return ""
    head = ("| method | seed | split | success@1 | success@N | draw@1 | draw@N | payoff@N |\n"
            "|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    dotted, rest = split_dotted(argv)
    p = ConfigErrorParser(prog="python -m experiments.table1", description="Table 1: methods x environments",
                allow_abbrev=False)
    p.add_argument("--envs", default=",".join(DEFAULT_ENVS),
                   help=f"comma-separated environments (default: {','.join(DEFAULT_ENVS)})")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated methods (default: {','.join(METHODS)})")
    p.add_argument("--preset", default="tiny", help="tiny (CPU), small or paper (need --model-path)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    p.add_argument("--out-dir", "--out", dest="out_dir", default=os.path.join("runs", "table1"),
                   help="where the runs and table.md go (default runs/table1)")
    p.add_argument("--figures-dir", default=None, help="also copy the plots here (e.g. docs/figures)")
    p.add_argument("--model-path", default=None, help="local Hugging Face folder (= --model.path)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key of every run (repeatable); --KEY VALUE works too")
    p.add_argument("--collect-only", action="store_true", help="tabulate finished runs, start nothing")
    try:
        args = p.parse_args(rest)
    except SystemExit:  # --help
        return 0
    envs = _csv(args.envs, list(ENVIRONMENTS), "--envs")
    methods = _csv(args.methods, list(METHODS), "--methods")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise C.ConfigError(f"--seeds must be comma-separated integers (got {args.seeds!r})") from None
    overrides: dict[str, Any] = dict(C.parse_assignment(s) for s in args.sets)
    overrides.update(dict(dotted))
    if args.model_path is not None:
        overrides["model.path"] = args.model_path
    variants = method_variants(methods)
    specs = {e: environment(e) for e in envs}
    for e, spec in specs.items():  # every config is checked before the first run starts
        for v in variants:
            variant_config(spec, v, args.preset, seeds[0], os.path.join(args.out_dir, e, v.name), overrides)

    results: dict[str, dict[str, Aggregate]] = {}
    details: list[str] = []
    for e, spec in specs.items():
        out = os.path.join(args.out_dir, e)
        records = run_suite(spec, variants, preset=args.preset, seeds=seeds, out_dir=out, overrides=overrides,
                            collect_only=args.collect_only)
        headline = spec.protocol(spec.config(args.preset, overrides, check_paths=False)).headline_split
        results[e] = aggregate(records, headline)
        paper = {m: f"{PAPER_TABLE1[m][e]:.3f}" for m in methods if e in PAPER_TABLE1.get(m, {})}
        details.append(markdown_table(results[e], paper=paper, title=f"{e} — split {headline}"))
        held = heldout_table(records, headline)
        if held:
            details.append(f"other evaluation splits of {e}:\n\n{held}")
        missing = [f"{r.variant}/seed{r.seed}" for r in records if r.summary is None]
        if missing:
            details.append(f"not finished on {e}: {', '.join(missing)}\n")
        if results[e]:
            figure = os.path.join(args.out_dir, f"table1_{e}.png")
            title = f"Table 1 runs on {e} ({args.preset}), split {headline}"
            plot_aggregates(results[e], figure, title=title)
            if args.figures_dir:
                os.makedirs(args.figures_dir, exist_ok=True)
                shutil.copy(figure, os.path.join(args.figures_dir, f"table1_{e}.png"))
    text = (f"# Table 1 — preset {args.preset}, seeds {','.join(map(str, seeds))}\n\n"
            "Final-episode success (mean ± SE over seeds) on each environment's headline split.\n\n"
            + overview_table(results, methods) + "\n" + "\n".join(details))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "table.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
