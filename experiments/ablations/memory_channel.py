"""Memory-channel ablation at the tiny scale: ``python -m experiments.ablations.memory_channel``.

MAGE's core channel is the agent's own reflection carried into the next episode. A model trained
from scratch cannot write English, so here a reflection is constrained, like an action, to
``<remark>`` + 1 to 3 words of a small vocabulary (``WORDS``: the card names, what the opponent did,
a judgement and the two actions) + ``</remark>``, and learned from scratch with the same credit
(a reflect row takes the return of the next play row, docs/method.md §4). Four arms, everything else
the ``tiny`` preset of ``experiments.kuhn_poker``:

* ``none`` — no memory at all: N = 3 episodes, the same credit, but no prompt shows an earlier
  episode, so the agent cannot adapt (the control);
* ``reflection_only`` — the next episode sees only the outcome and the constrained reflection of each
  earlier one: adaptation must pass through the words the agent chose;
* ``history_only`` — the trajectories of the earlier episodes (the ``tiny`` preset itself);
* ``history_and_reflection`` — both.

Besides the common table, the report lists per arm: payoff@3 − payoff@1, the seeds that adapted
(final payoff more than 0.1 chips above the first), the final payoff against the best fixed strategy,
and, for the arms with reflections, the most frequent reflections of the final evaluation per
opponent and seat (top 3 with their shares).

    python -m experiments.ablations.memory_channel --seeds 0,1,2,3,4 --out-dir runs/abl/memory_channel
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from experiments.ablations.common import Ablation
from experiments.suite import Aggregate, RunRecord, Variant

WORDS = ("Jack", "Queen", "King", "bets", "passes", "calls", "folds", "bluff", "strong", "weak", "BET",
         "PASS")
"""The reflection vocabulary: card names and actions as the prompts write them, and what an opponent
did or holds."""
MAX_WORDS = 3
ARMS = ("none", "reflection_only", "history_only", "history_and_reflection")
ADAPTED = 0.1
"""A seed adapted when its final payoff is more than this many chips above its first-episode payoff."""
TOP = 3


def _reflections(memory_mode: str) -> dict[str, object]:
    return {"rollout.memory_mode": memory_mode, "rollout.reflect": True,
            "rollout.reflection_words": list(WORDS), "rollout.reflection_max_words": MAX_WORDS}


def variants(env: str) -> list[Variant]:
    return [
        Variant("none", {"rollout.memory_mode": "none", "rollout.reflect": False}),
        Variant("reflection_only", _reflections("reflection_only")),
        Variant("history_only", {"rollout.memory_mode": "history_only", "rollout.reflect": False}),
        Variant("history_and_reflection", _reflections("history_and_reflection")),
    ]


def adaptation_table(aggregates: Mapping[str, Aggregate]) -> str:
    """Per arm: success@K, payoff@1, payoff@K, their difference, adapted seeds, final payoff − best fixed."""
    lines = ["| arm | seeds | success@K | payoff@1 | payoff@K | payoff@K − payoff@1 | adapted seeds | "
             "payoff@K − best fixed |", "|---|---|---|---|---|---|---|---|"]
    for name, a in aggregates.items():
        gains = [last - first for _, first, last in a.per_seed.values()]
        adapted = sum(g > ADAPTED for g in gains)
        best = (a.reference or {}).get("best_fixed_payoff")
        versus = f"{a.payoff[-1] - best[-1]:+.3f}" if best else "–"
        lines.append(f"| {name} | {len(a.seeds)} | {a.success[-1]:.3f} | {a.payoff[0]:+.3f} | "
                     f"{a.payoff[-1]:+.3f} | {a.payoff[-1] - a.payoff[0]:+.3f} | "
                     f"{adapted} of {len(a.seeds)} | {versus} |")
    return "\n".join(lines) + "\n"


def reflection_listing(records: Sequence[RunRecord], split: str) -> str:
    """Per arm with reflections and per seed: the ``TOP`` most frequent reflections of the final evaluation
    for every opponent and seat, with their share of that group's reflections."""
    out = []
    for arm in dict.fromkeys(r.variant for r in records):
        runs = [r for r in records if r.variant == arm and r.summary is not None]
        blocks = {r.seed: ((r.summary["evaluation"].get(split) or {}).get("metrics") or {}).get("reflections")
                  for r in runs}
        blocks = {seed: b for seed, b in blocks.items() if b}
        if not blocks:
            continue
        groups = sorted({g for b in blocks.values() for g in b})
        out += [f"most frequent reflections, {arm} (top {TOP} per opponent and seat, share of its "
                "reflections):",
                "", "| opponent/seat | " + " | ".join(f"seed {s}" for s in blocks) + " |",
                "|" + "---|" * (len(blocks) + 1)]
        for group in groups:
            cells = []
            for block in blocks.values():
                entry = block.get(group)
                if not entry:
                    cells.append("–")
                    continue
                cells.append(", ".join(f"`{text}` {count / entry['count']:.0%}"
                                       for text, count in entry["top"][:TOP]) + f" (n={entry['count']})")
            out.append(f"| {group} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out) + ("\n" if out else "")


def report(records: Sequence[RunRecord], aggregates: Mapping[str, Aggregate], split: str) -> str:
    if not aggregates:
        return ""
    return (f"adaptation (K = last episode; adapted: payoff@K − payoff@1 > {ADAPTED}):\n\n"
            + adaptation_table(aggregates) + "\n" + reflection_listing(records, split))


ABLATION = Ablation(
    name="memory_channel",
    title="Memory channel (constrained reflections at the tiny scale)",
    variants=variants,
    variant_names=ARMS,
    envs=("kuhn_poker",),
    report=report,
)

main = ABLATION.main

if __name__ == "__main__":
    sys.exit(main())
