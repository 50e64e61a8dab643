"""The methods of the paper's Table 1 as config transformations: ``python -m experiments.baselines``.

| method    | training                                              | evaluation                          |
|-----------|-------------------------------------------------------|-------------------------------------|
| mage      | N = 3, differential meta-reward, GiGPO                | meta-episodes with memory           |
| lamer     | N = 3, cumulative meta-reward (LaMer), GiGPO           | meta-episodes with memory           |
| gigpo     | single episode (N = 1), group 24, GiGPO               | N independent attempts, no memory   |
| grpo      | single episode (N = 1), group 24, GRPO                | N independent attempts, no memory   |
| react     | none (the pretrained model)                           | N independent attempts, no memory   |
| reflexion | none (the pretrained model)                           | meta-episodes with reflections      |

A method is applied on top of an environment preset (``experiments.environments.environment``) and
before the command line's own overrides. ReAct and Reflexion evaluate the initial model: at the
``tiny`` scale that is an untrained random network (close to a uniformly random legal-move policy
under constrained decoding), so their tiny numbers only anchor the table; they are meant for the
pretrained ``small`` / ``paper`` presets.

Examples::

    python -m experiments.baselines --env kuhn_poker --method lamer            # tiny, CPU
    python -m experiments.baselines --env tic_tac_toe --method grpo --train.iterations 30
    python -m experiments.baselines --env alfworld --method reflexion --preset paper --model-path DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from experiments.common import EXIT_INTERRUPTED, Preset, RunOptions, run_cli
from experiments.environments import ENVIRONMENTS, environment
from experiments.presets import EnvExperiment
from mage_jax import config as C
from mage_jax.evaluation.evaluator import EvalProtocol
from mage_jax.evaluation.report import results_table
from mage_jax.training.run import RunOutcome

SINGLE_EPISODE_GROUP = 24


@dataclasses.dataclass(frozen=True)
class Method:
    """A Table 1 method: config overrides, whether it trains, and how it is evaluated."""

    name: str
    overrides: Mapping[str, Any]
    trains: bool = True
    eval_mode: str = "meta"
    description: str = ""


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("mage", {"algorithm.reward": "differential", "algorithm.estimator": "gigpo"},
               description="MAGE: differential meta-reward (final-episode objective) + GiGPO"),
        Method("lamer", {"algorithm.reward": "cumulative", "algorithm.estimator": "gigpo"},
               description="LaMer: cumulative meta-reward + GiGPO"),
        Method("gigpo", {"rollout.num_episodes": 1, "rollout.group_size": SINGLE_EPISODE_GROUP,
                         "algorithm.reward": "single_episode", "algorithm.estimator": "gigpo"},
               eval_mode="independent", description="GiGPO: single-episode RL, group 24"),
        Method("grpo", {"rollout.num_episodes": 1, "rollout.group_size": SINGLE_EPISODE_GROUP,
                        "algorithm.reward": "single_episode", "algorithm.estimator": "grpo"},
               eval_mode="independent", description="GRPO: single-episode RL, group 24"),
        Method("react", {"train.iterations": 0}, trains=False, eval_mode="independent",
               description="ReAct: the initial model, independent attempts"),
        Method("reflexion", {"train.iterations": 0}, trains=False,
               description="Reflexion: the initial model with memory (reflections) between episodes"),
    )
}

_TABLE1_ENVS = ("kuhn_poker", "tic_tac_toe", "alfworld", "sokoban", "webshop")
PAPER_TABLE1: dict[str, dict[str, float]] = {
    name: dict(zip(_TABLE1_ENVS, values))
    for name, values in (
        ("react", (0.648, 0.039, 0.234, 0.383, 0.039)),
        ("reflexion", (0.648, 0.242, 0.391, 0.438, 0.039)),
        ("grpo", (0.648, 0.219, 0.836, 0.602, 0.711)),
        ("gigpo", (0.656, 0.414, 0.883, 0.719, 0.797)),
        ("lamer", (0.594, 0.602, 0.898, 0.688, 0.703)),
        ("mage", (0.656, 0.672, 0.914, 0.773, 1.000)),
    )
}
"""docs/method.md §10: final-episode success on 128 evaluation instances (Qwen3-4B)."""


def method(name: str) -> Method:
    if name not in METHODS:
        raise C.ConfigError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    return METHODS[name]


def method_presets(env: EnvExperiment, m: Method) -> dict[str, Preset]:
    """The environment's presets with the method's overrides applied on top."""
    return {name: dataclasses.replace(p, overrides={**p.overrides, **m.overrides},
                                      description=f"{p.description}; {m.description}")
            for name, p in env.presets.items()}


def method_protocol(env: EnvExperiment, m: Method, cfg: C.ExperimentConfig) -> EvalProtocol:
    return dataclasses.replace(env.protocol(cfg), eval_mode=m.eval_mode)


def method_config(env_name: str, method_name: str, preset: str = "tiny",
                  overrides: Mapping[str, Any] | None = None, *,
                  check_paths: bool = True) -> C.ExperimentConfig:
    """The validated config of ``method`` on ``env`` at ``preset`` (one-line ConfigError on problems)."""
    env, m = environment(env_name), method(method_name)
    spec = dataclasses.replace(env, presets=method_presets(env, m))
    return spec.config(preset, overrides, check_paths=check_paths, experiment=f"{env_name}_{method_name}")


def run_method(env_name: str, method_name: str, cfg: C.ExperimentConfig, *, resume: bool = False,
               protocol: EvalProtocol | None = None) -> RunOutcome:
    """Train and evaluate (or only evaluate) one method on one environment."""
    env, m = environment(env_name), method(method_name)
    return env.run(cfg, resume=resume, trains=m.trains, protocol=protocol or method_protocol(env, m, cfg))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    head = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    head.add_argument("--env", default="kuhn_poker")
    head.add_argument("--method", default="mage")
    known, rest = head.parse_known_args(argv)
    try:
        env, m = environment(known.env), method(known.method)
    except C.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    def run(cfg: C.ExperimentConfig, options: RunOptions) -> int:
        outcome = run_method(known.env, known.method, cfg, resume=options.resume)
        if outcome.status != "finished":
            print(f"stopped; continue with --run-dir {options.run_dir} --resume", file=sys.stderr)
            return EXIT_INTERRUPTED
        print(results_table(outcome.summary, env.titles))
        return 0

    extra = (("--env", {"default": known.env, "help": f"environment, one of {', '.join(ENVIRONMENTS)} "
                                                       "(default: kuhn_poker)"}),
             ("--method", {"default": known.method, "help": "Table 1 method: " + "; ".join(
                 f"{k}: {v.description}" for k, v in METHODS.items()) + " (default: mage)"}))
    return run_cli(rest, run, experiment=f"{known.env}_{known.method}", presets=method_presets(env, m),
                   default_preset=env.default_preset, prog="python -m experiments.baselines", extra=extra,
                   description=f"Table 1 methods on the environments; now: {m.description} on {known.env}")


if __name__ == "__main__":
    sys.exit(main())
