"""What every ablation module shares: its variants, the paper's numbers and the command line."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence

from experiments.common import run_command
from experiments.environments import environment
from experiments.suite import (
    Aggregate,
    RunRecord,
    Variant,
    aggregate,
    markdown_table,
    parse_suite_args,
    plot_aggregates,
    run_suite,
    variant_config,
    variant_protocol,
)

GAMES = ("kuhn_poker", "tic_tac_toe")


@dataclasses.dataclass(frozen=True)
class Ablation:
    """An ablation: a function from the environment to its variants, and the paper's numbers."""

    name: str
    title: str
    variants: Callable[[str], Sequence[Variant]]
    variant_names: tuple[str, ...]
    paper: Mapping[str, str] = dataclasses.field(default_factory=dict)
    paper_note: str = ""
    envs: tuple[str, ...] = GAMES
    default_env: str = "kuhn_poker"
    report: Callable[[Sequence[RunRecord], Mapping[str, Aggregate], str], str] | None = None
    """More markdown after the common table, from the runs, their aggregates and the headline split."""

    def main(self, argv: Sequence[str] | None = None) -> int:
        return run_command(lambda: self._main(argv))

    def _main(self, argv: Sequence[str] | None) -> int:
        args = parse_suite_args(argv, name=f"ablations.{self.name}", description=self.title,
                                variants=self.variant_names, envs=self.envs, default_env=self.default_env)
        env = environment(args.env)
        variants = [v for v in self.variants(args.env) if v.name in args.variants]
        # Build and check every config before the first run starts (a missing model folder fails here).
        first_cfg = None
        for v in variants:
            cfg = variant_config(env, v, args.preset, args.seeds[0], os.path.join(args.out_dir, v.name),
                                 args.overrides)
            variant_protocol(env, v, cfg)
            first_cfg = first_cfg or cfg
        records = run_suite(env, variants, preset=args.preset, seeds=args.seeds, out_dir=args.out_dir,
                            overrides=args.overrides, collect_only=args.collect_only)
        split = env.protocol(first_cfg).headline_split
        aggregates = aggregate(records, split)
        labels = {v.name: v.label or v.name for v in variants}
        title = (f"{self.title} — {args.env}, preset {args.preset}, seeds {','.join(map(str, args.seeds))}, "
                 f"split {split}")
        table = markdown_table(aggregates, paper=self.paper, title=title, labels=labels)
        if self.paper_note:
            table += f"\npaper: {self.paper_note}\n"
        if self.report is not None:
            table += "\n" + self.report(records, aggregates, split)
        missing = [f"{r.variant}/seed{r.seed}" for r in records if r.summary is None]
        if missing:
            table += f"\nnot finished: {', '.join(missing)}\n"
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "table.md"), "w") as f:
            f.write(table)
        if aggregates:
            plot_aggregates(aggregates, os.path.join(args.out_dir, "plot.png"), title=title, labels=labels)
            if args.figure:
                plot_aggregates(aggregates, args.figure, title=title, labels=labels)
        print(table)
        return 0


def training_pool(env: str) -> dict[str, float]:
    """The balanced pool of the environment's presets (what every pool variant is evaluated on)."""
    cfg = environment(env).config("tiny", check_paths=False)
    return dict(zip(cfg.env.opponents, cfg.env.opponent_ratios))
