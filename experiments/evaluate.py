"""Evaluation only: a trained checkpoint, or a local Hugging Face model zero-shot.

    python -m experiments.evaluate --checkpoint runs/kuhn_poker/RUN [--step K] [--out-dir DIR]
    python -m experiments.evaluate --model-path /models/Qwen3-4B --env kuhn_poker --method reflexion \\
        --preset paper
    python -m experiments.evaluate --model-path /models/Qwen3-4B --env tic_tac_toe --method react

``--checkpoint`` takes a run directory (its ``config.json``, tokenizer and latest checkpoint, or
``--step K``, or with ``--best`` the best validated state of a run with ``train.validate_every``)
and evaluates the trained parameters with the run's evaluation protocol: held-out instances of the
training pool, the held-out opponent, and for Kuhn Poker the oracle references on the same
meta-episodes. Results go to ``--out-dir`` (alias ``--out``) (default ``<run>/eval-<timestamp>``):
``summary.json`` and ``metrics.jsonl``; the table is printed.

``--model-path DIR --adapter FILE`` evaluates LoRA adapters exported from a run
(``python -m experiments.export --run-dir RUN --adapter FILE``) on the base model folder ``DIR``: the
file carries the run's config, iteration and evaluation key, so this replays the run's own evaluation
(the same protocol, meta-episodes and sampling key); ``--set`` changes keys as usual, e.g.
``--set env.eval_seed=7`` for other held-out deals, ``--set train.eval_meta_episodes=512``::

    python -m experiments.evaluate --model-path ~/models/smollm2 \
        --adapter experiments/adapters/smollm2_kuhn_mage_lora_adapter.safetensors

``--model-path`` alone evaluates a pretrained model without training: ``--method reflexion`` plays
meta-episodes with reflections between episodes (the Reflexion baseline), ``--method react`` plays N
independent attempts without memory (the ReAct baseline); ``--preset small|small-lora|small-cpu|paper``
picks the scale (``small-cpu``: a 135M-0.6B model on a CPU, constrained actions, 32 meta-episodes)::

    python -m experiments.evaluate --model-path ~/models/smollm2 --env kuhn_poker --method reflexion \
        --preset small-cpu

Evaluation keys of the config may be overridden as usual (``--train.eval_meta_episodes 512``,
``--sampling.eval.temperature 0.7``); any problem is one ``error:`` line and exit status 2.
SIGTERM or Ctrl-C stops the evaluation at its next turn with one line saying what the output folder
holds (exit status 75, no traceback); a second Ctrl-C exits at once (130), as does a Ctrl-C while the
evaluation is built; an environment that fails is one ``error:`` line (4). docs/reliability.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from experiments.baselines import method as get_method
from experiments.baselines import method_config, method_protocol
from experiments.common import (
    EXIT_CONFIG_ERROR,
    EXIT_ENVIRONMENT_FAILED,
    EXIT_INTERRUPTED,
    ConfigErrorParser,
    format_keys,
    split_dotted,
)
from experiments.environments import environment
from mage_jax import compilation_cache, host_random
from mage_jax import config as C
from mage_jax.configtools import from_dict
from mage_jax.envs.workers import EnvWorkerError
from mage_jax.evaluation.evaluator import EvalProtocol
from mage_jax.evaluation.report import results_table
from mage_jax.models.adapter_file import apply_adapters, read_adapters
from mage_jax.models.hub import resolve_model_path
from mage_jax.training.assemble import best_checkpoint_dir, build_parts, checkpoint_dir, evaluation_key
from mage_jax.training.checkpoint import key_from_json
from mage_jax.training.run import EvaluationInterrupted, RunOutcome, evaluate
from mage_jax.training.signals import EXIT_SECOND_INTERRUPT, hold_until_exit

ZERO_SHOT_METHODS = ("react", "reflexion")


def _parser() -> argparse.ArgumentParser:
    p = ConfigErrorParser(prog="python -m experiments.evaluate", description=__doc__.split("\n\n")[0],
               allow_abbrev=False)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", "--run-dir", dest="checkpoint",
                     help="a run directory with config.json and checkpoints/")
    src.add_argument("--model-path",
                     help="a local Hugging Face model folder, or a Hub name in the local cache (zero-shot)")
    p.add_argument("--adapter", default=None,
                   help="with --model-path: LoRA adapters exported from a run (experiments.export "
                        "--adapter); the run's config comes from the file")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--best", action="store_true",
                   help="the best validated state (train.validate_every) instead of the latest checkpoint")
    p.add_argument("--env", default=None, help="environment (with --model-path; default kuhn_poker)")
    p.add_argument("--method", choices=ZERO_SHOT_METHODS, default=None,
                   help="zero-shot baseline (default reflexion)")
    p.add_argument("--preset", default=None,
                   help="scale of the zero-shot config: small (default), small-lora, small-cpu, "
                        "smollm2-cpu or paper")
    p.add_argument("--out-dir", "--out", dest="out_dir", default=None,
                   help="output directory (default <run>/eval-<timestamp>, zero-shot runs/<env>_<method>/)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable); --KEY VALUE works too")
    p.add_argument("--list-keys", action="store_true", help="print every config key and exit")
    return p


def _timestamp() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def evaluate_checkpoint(run_dir: str, *, step: int | None = None, out_dir: str | None = None,
                        overrides: dict[str, Any] | None = None, best: bool = False) -> RunOutcome:
    """Evaluate the parameters of a run's checkpoint (``best``: its best validated state) with its
    environment's protocol; writes ``summary.json`` in ``out_dir``."""
    if not os.path.isfile(os.path.join(run_dir, C.CONFIG_FILE)):
        raise C.ConfigError(f"--checkpoint {run_dir!r} holds no {C.CONFIG_FILE}; pass a run directory")
    cfg = C.apply_overrides(C.load(run_dir), overrides or {})
    out_dir = out_dir or os.path.join(run_dir, f"eval-{_timestamp()}")
    cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, run_dir=out_dir))
    C.validate(cfg)
    try:
        protocol = environment(cfg.env.name).protocol(cfg)
    except C.ConfigError:  # an environment without an experiment module: the built-in splits only
        protocol = EvalProtocol(random_reference=False)
    parts = build_parts(cfg, run_dir, eval_mode=protocol.eval_mode)  # the run's own tokenizer
    directory = best_checkpoint_dir(cfg, run_dir) if best else checkpoint_dir(cfg, run_dir)
    params, meta = parts.restore_params(directory, step)
    iteration = int(meta.get("iteration", 0))
    base_key = key_from_json(meta["rng"]) if "rng" in meta else host_random.key(cfg.train.seed)
    return evaluate(cfg, protocol, experiment=f"{cfg.name}_eval", parts=parts, params=params,
                    key=evaluation_key(base_key, iteration), iteration=iteration,
                    checkpoint=os.path.abspath(run_dir))


def evaluate_zero_shot(model_path: str, *, env: str, method: str, preset: str, out_dir: str | None,
                       overrides: dict[str, Any]) -> RunOutcome:
    """ReAct / Reflexion: the pretrained model of ``model_path`` evaluated without training."""
    out_dir = out_dir or os.path.join("runs", f"{env}_{method}", _timestamp())
    cfg = method_config(env, method, preset,
                        {**overrides, "model.path": model_path, "logging.run_dir": out_dir})
    return evaluate(cfg, method_protocol(environment(env), get_method(method), cfg),
                    experiment=f"{env}_{method}")


def evaluate_adapter(model_path: str, adapter: str, *, out_dir: str | None,
                     overrides: dict[str, Any]) -> RunOutcome:
    """LoRA adapters of a run (an ``experiments.export --adapter`` file) on the base model ``model_path``,
    evaluated with the run's config (``overrides`` on top) and its evaluation key."""
    try:
        file = read_adapters(adapter)
    except ValueError as err:
        raise C.ConfigError(f"--adapter: {err}") from None
    if "config" not in file.metadata:
        raise C.ConfigError(f"--adapter {adapter!r} records no run config (write it with experiments.export "
                            "--adapter)")
    try:
        recorded = from_dict(C.ExperimentConfig, json.loads(file.metadata["config"]))
    except (ValueError, TypeError) as err:
        raise C.ConfigError(f"--adapter {adapter!r}: its recorded config is damaged ({err})") from None
    out_dir = out_dir or os.path.join("runs", f"{recorded.env.name}_adapter", _timestamp())
    cfg = C.apply_overrides(recorded, {**file.model_overrides(), "tokenizer.path": None, **overrides,
                                       "model.path": model_path, "logging.run_dir": out_dir})
    C.validate(cfg)
    try:
        protocol = environment(cfg.env.name).protocol(cfg)
    except C.ConfigError:  # an environment without an experiment module: the built-in splits only
        protocol = EvalProtocol(random_reference=False)
    parts = build_parts(cfg, out_dir, eval_mode=protocol.eval_mode)
    try:
        params = apply_adapters(parts.init_params, parts.model_config, file)
    except ValueError as err:
        raise C.ConfigError(f"--adapter {adapter!r}: {err}") from None
    iteration = int(file.metadata.get("iteration", 0))
    rng = file.metadata.get("rng")
    base_key = key_from_json(json.loads(rng)) if rng else host_random.key(cfg.train.seed)
    return evaluate(cfg, protocol, experiment=f"{cfg.name}_adapter", parts=parts, params=params,
                    key=evaluation_key(base_key, iteration), iteration=iteration,
                    adapter=os.path.abspath(adapter))


def main(argv: Sequence[str] | None = None) -> int:
    """The command; in its own process a signal during the interpreter's exit ends it at once
    (``signals.hold_until_exit``)."""
    code = _main(list(sys.argv[1:] if argv is None else argv))
    hold_until_exit(code)
    return code


def _main(argv: list[str]) -> int:
    try:
        dotted, rest = split_dotted(argv)
        if "--list-keys" in rest:
            print(format_keys())
            return 0
        try:
            args = _parser().parse_args(rest)
        except SystemExit:  # --help
            return 0
        overrides = dict([C.parse_assignment(s) for s in args.sets] + dotted)
        compilation_cache.enable(overrides.get("compile.cache_dir"))
        if args.adapter and not args.model_path:  # (with --checkpoint)
            raise C.ConfigError("--adapter needs --model-path: the base model folder the adapters were "
                                "trained on")
        if args.checkpoint:
            outcome = evaluate_checkpoint(args.checkpoint, step=args.step, out_dir=args.out_dir,
                                          overrides=overrides, best=args.best)
        else:
            args.model_path = resolve_model_path(args.model_path)
            if not os.path.isdir(args.model_path):
                raise C.ConfigError(f"--model-path {args.model_path!r} is not a folder")
            if args.adapter:
                given = [f"--{n}" for n in ("env", "method", "preset") if getattr(args, n) is not None]
                if given:
                    raise C.ConfigError(f"--adapter carries its run's config: {', '.join(given)} do not "
                                        "apply (change keys with --set KEY=VALUE)")
                outcome = evaluate_adapter(args.model_path, args.adapter, out_dir=args.out_dir,
                                           overrides=overrides)
            else:
                outcome = evaluate_zero_shot(args.model_path, env=args.env or "kuhn_poker",
                                             method=args.method or "reflexion", preset=args.preset or "small",
                                             out_dir=args.out_dir, overrides=overrides)
    except C.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except EnvWorkerError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_ENVIRONMENT_FAILED
    except EvaluationInterrupted as err:
        print(err, file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # Ctrl-C while the model loads, before the evaluation's own handlers are set
        print("interrupted before the evaluation started: nothing was evaluated or kept", file=sys.stderr)
        return EXIT_SECOND_INTERRUPT
    print(results_table(outcome.summary, environment(outcome.parts.cfg.env.name).titles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
