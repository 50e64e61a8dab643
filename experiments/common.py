"""Command-line plumbing shared by the experiment modules: presets, overrides, run directories.

Every experiment module (``python -m experiments.<name>``) accepts the same flags:

    --preset NAME            start from a named preset of the experiment (default: the module's)
    --config FILE            start from a saved config.json instead of a preset
    --set KEY=VALUE          override one config key (repeatable), e.g. --set optim.lr=1e-3
    --KEY VALUE / --KEY=VALUE  the same, e.g. --optim.lr 1e-3 --rollout.reflect false
    --run-dir DIR            where the run writes (default runs/<experiment>/<timestamp>)
    --model-path DIR         shorthand for --model.path DIR (a local Hugging Face folder, or a Hub
                             name such as Qwen/Qwen3-4B found in the local Hugging Face cache)
    --resume                 continue the run in --run-dir from its latest checkpoint
    --list-keys              print every config key (type, default, the preset's value, docstring)

Every problem with the command line or the resulting config is reported as ONE line on stderr
(``error: ...``) with exit status 2, before anything is written; problems found while the run is
built (``training.run``) are one line too and leave nothing behind. Exit status of a run: 0 finished;
3 stopped because training cannot make progress (one ``error:`` line); 4 an environment failed (a
worker died, raised or stopped answering; one ``error:`` line); 75 interrupted by SIGTERM or Ctrl-C
(checkpoint saved, the ``--resume`` command printed); 130 a second Ctrl-C, or a Ctrl-C before the run
started (nothing saved). docs/reliability.md lists every promise and the test behind it.

Resume: the saved config is the run's; only the keys of ``RESUMABLE_KEYS`` may change (anything else
is one line, and nothing is rewritten; so is a ``config.json`` edited by hand since its checkpoint).
A run marked finished (``finished.json``) is reported finished, unless ``--train.iterations`` asks for
more.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mage_jax import compilation_cache
from mage_jax import config as C
from mage_jax.envs.workers import EnvWorkerError
from mage_jax.models.hub import resolve_model_path
from mage_jax.models.sharding import initialize_from_environment
from mage_jax.training.health import TrainingStopped
from mage_jax.training.run import EvaluationInterrupted, finished_iteration
from mage_jax.training.signals import EXIT_SECOND_INTERRUPT, hold_until_exit

EXIT_CONFIG_ERROR = 2
EXIT_TRAINING_STOPPED = 3
"""The run stopped because it cannot make progress (``TrainingStopped``: updates keep being skipped, or
an iteration has no valid row); one ``error:`` line names the cause and the last checkpoint."""
EXIT_ENVIRONMENT_FAILED = 4
"""An environment failed: a worker process died, an environment raised inside one, or a worker sent
nothing for ``env.reply_timeout`` seconds. One ``error:`` line names the environment, the meta-episode and
the operation; nothing after the last checkpoint was saved, and the ``--resume`` command is printed."""
EXIT_INTERRUPTED = 75
"""SIGTERM / SIGINT: a checkpoint was saved and the exact ``--resume`` command printed (EX_TEMPFAIL: a
scheduler may simply run that command again); an evaluation-only run stops at its next turn and says
what its directory holds. A second Ctrl-C exits at once with 130, saving nothing (so does a Ctrl-C
before the run started, while it was being built)."""
RESUMABLE_KEYS = C.RESUMABLE_KEYS


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named override map on top of ``ExperimentConfig()``.

    ``needs_model_path``: the preset loads a pretrained model (``small``, ``paper``), so a missing
    ``model.path`` is a configuration error with a hint instead of a failure deep in the run.
    ``requires``: a further check of the resolved config (e.g. WebShop's ``paper`` preset needs the
    official data files); it raises one ``ConfigError`` before anything is written.
    """

    overrides: Mapping[str, Any]
    description: str = ""
    needs_model_path: bool = False
    requires: Callable[[C.ExperimentConfig], None] | None = None
    hardware: tuple[str, ...] = ()
    """The hardware the preset is meant for, as names of ``experiments.plan.HARDWARE`` (each at its own
    device count): ``python -m experiments.plan`` judges these by default, and a test holds every preset
    to fitting them."""

    def check(self, name: str, cfg: C.ExperimentConfig, *, check_paths: bool = True) -> None:
        """Raise one ``ConfigError`` when ``cfg`` lacks what preset ``name`` needs (the model folder
        first, then the general validation, then ``requires``)."""
        if self.needs_model_path and cfg.model.path is None:
            raise C.ConfigError(
                f"preset {name!r} loads a pretrained model: pass its local Hugging Face folder with "
                "--model-path DIR (config.json, *.safetensors, tokenizer files)")
        if self.requires is not None:
            C.validate(cfg, check_paths=check_paths)
            if check_paths:
                self.requires(cfg)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What the command line says besides the config itself."""

    preset: str | None
    run_dir: str
    resume: bool


class ConfigErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are ``ConfigError`` (one ``error:`` line, exit 2), not usage text."""

    def error(self, message: str) -> None:
        raise C.ConfigError(message)


def _parser(prog: str, description: str, presets: Mapping[str, Preset],
            default_preset: str, extra: Sequence[tuple[str, Mapping[str, Any]]] = ()) -> ConfigErrorParser:
    p = ConfigErrorParser(prog=prog, description=description, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="Config keys take --KEY VALUE or --set KEY=VALUE, e.g. --optim.lr 1e-3 "
                       "(list them with --list-keys). Presets: "
                       + "; ".join(f"{k}: {v.description}" for k, v in presets.items()))
    for flag, options in extra:  # the entry point's own flags, listed by --help
        p.add_argument(flag, **options)
    p.add_argument("--preset", choices=sorted(presets), default=None,
                   help=f"named preset (default: {default_preset})")
    p.add_argument("--config", default=None, help="start from this config.json instead of a preset")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--run-dir", default=None, help="run directory (default runs/<experiment>/<timestamp>)")
    p.add_argument("--model-path", default=None,
                   help="local Hugging Face model folder, or a Hub name in the HF cache (= --model.path)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its latest checkpoint")
    p.add_argument("--list-keys", action="store_true", help="print every config key and exit")
    return p


def _show(value: Any) -> str:
    return json.dumps(C.to_dict(value) if dataclasses.is_dataclass(value) else value, default=str)


def format_keys(preset_cfg: C.ExperimentConfig | None = None, preset: str | None = None) -> str:
    """Every config key: its type, default, the value of ``preset`` and its docstring (``--list-keys``)."""
    lines = []
    for info in C.describe_keys():
        head = f"--{info.key}  ({info.type_name})  default: {_show(info.default)}"
        if preset_cfg is not None:
            head += f"  preset {preset}: {_show(C.get_key(preset_cfg, info.key))}"
        lines.append(head)
        if info.doc:
            lines.append(f"      {info.doc}")
    return "\n".join(lines)


def split_dotted(argv: Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Separate ``--section.key VALUE`` / ``--section.key=VALUE`` overrides from the other arguments."""
    dotted: list[tuple[str, str]] = []
    rest: list[str] = []
    i = 0
    argv = list(argv)
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            name, sep, value = arg[2:].partition("=")
            if not sep:
                if i + 1 >= len(argv):
                    raise C.ConfigError(f"--{name} needs a value")
                value = argv[i + 1]
                i += 1
            dotted.append((name, value))
        else:
            rest.append(arg)
        i += 1
    return dotted, rest


def default_run_dir(experiment: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", experiment, stamp)


def parse_command_line(
    argv: Sequence[str] | None,
    *,
    experiment: str,
    presets: Mapping[str, Preset],
    default_preset: str,
    description: str = "",
    prog: str | None = None,
    extra: Sequence[tuple[str, Mapping[str, Any]]] = (),
) -> tuple[C.ExperimentConfig, RunOptions] | None:
    """Build and validate the config of a command line; ConfigError on any problem.

    ``prog`` names the module (default ``python -m experiments.<experiment>``); ``extra`` are the entry
    point's own flags (already read by it), so that ``--help`` lists them. Returns None when the command
    only asked for information (``--list-keys``, ``--help``, ``--resume`` of a finished run).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    dotted, rest = split_dotted(argv)
    parser = _parser(prog or f"python -m experiments.{experiment}", description, presets, default_preset,
                     extra)
    try:
        args = parser.parse_args(rest)
    except SystemExit:  # --help
        return None
    if args.list_keys:
        name = args.preset or default_preset
        preset_cfg = C.apply_overrides(C.ExperimentConfig(name=experiment), presets[name].overrides)
        print(format_keys(preset_cfg, name))
        return None
    overrides: list[tuple[str, str]] = [C.parse_assignment(s) for s in args.sets] + dotted
    if args.model_path is not None:
        overrides.append(("model.path", resolve_model_path(args.model_path)))

    run_dir = args.run_dir
    if args.resume:
        if run_dir is None:
            raise C.ConfigError("--resume needs --run-dir DIR (the run to continue)")
        if not os.path.isfile(os.path.join(run_dir, C.CONFIG_FILE)):
            raise C.ConfigError(f"--resume: {run_dir!r} holds no {C.CONFIG_FILE}; nothing to resume")
        if args.preset is not None or args.config is not None:
            raise C.ConfigError("--resume continues the run's saved config; drop --preset / --config")
        saved = C.with_model_folder(C.load(run_dir))
        cfg = C.with_model_folder(C.apply_overrides(saved, _ordered(overrides)))
        _check_resume_overrides(saved, cfg)
        preset_name = None
    else:
        preset_name = args.preset or default_preset
        if args.config is not None:
            if args.preset is not None:
                raise C.ConfigError("give either --preset or --config, not both")
            cfg = C.load(args.config)
            preset_name = None
        else:
            cfg = C.apply_overrides(C.ExperimentConfig(name=experiment), presets[preset_name].overrides)
        cfg = C.with_model_folder(C.apply_overrides(cfg, _ordered(overrides)))
    if run_dir is None:
        run_dir = cfg.logging.run_dir or default_run_dir(experiment)
    cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, run_dir=run_dir))
    if preset_name is not None:
        presets[preset_name].check(preset_name, cfg)
    check_consistent(cfg, preset_name)
    C.validate(cfg)
    check_run_dir(run_dir)
    if not args.resume and os.path.exists(os.path.join(run_dir, C.CONFIG_FILE)):
        raise C.ConfigError(f"run directory {run_dir!r} already holds a run; pass --resume to continue it "
                            "or choose another --run-dir")
    if args.resume:
        done = finished_iteration(run_dir)
        if done is not None and cfg.train.iterations <= done:
            print(f"run {run_dir!r} finished at iteration {done} (see its summary.json); nothing to resume. "
                  f"Raise --train.iterations to train it further.", file=sys.stderr)
            return None
    return cfg, RunOptions(preset=preset_name, run_dir=run_dir, resume=bool(args.resume))


def _check_resume_overrides(saved: C.ExperimentConfig, cfg: C.ExperimentConfig) -> None:
    """One ConfigError naming the first changed key that ``--resume`` may not change."""
    changed = C.resume_changes(C.to_dict(saved), cfg)
    if changed:
        key, before, value = changed[0]
        raise C.ConfigError(
            f"--resume cannot change {key} (saved {before!r}, asked {value!r}); a resumed run "
            f"may change only {', '.join(k.rstrip('.') for k in RESUMABLE_KEYS)}; start a new run with "
            "another --run-dir for the rest")


def check_consistent(cfg: C.ExperimentConfig, preset: str | None = None) -> None:
    """One ConfigError for settings that each are valid but make no sense together."""
    named = f"preset {preset!r}" if preset else "this config"
    if cfg.model.path is not None and cfg.tokenizer.kind == "word_level":
        raise C.ConfigError(
            f"{named} trains a from-scratch model with its own word-level tokenizer, but --model-path loads "
            "pretrained weights that need their own tokenizer; use --preset small or paper with "
            "--model-path (or set --tokenizer.kind hf)")


def check_run_dir(run_dir: str) -> None:
    """One ConfigError unless ``run_dir`` is (or can be made) a writable folder."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise C.ConfigError(f"--run-dir {run_dir!r} is a file, not a folder")
    parent = os.path.abspath(run_dir)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise C.ConfigError(f"--run-dir {run_dir!r} cannot be created: {parent!r} is a file")
    if not os.access(parent, os.W_OK):
        raise C.ConfigError(f"--run-dir {run_dir!r} cannot be written: no write permission in {parent!r}")


def _ordered(pairs: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in pairs:  # the last value of a repeated key wins
        out.pop(k, None)
        out[k] = v
    return out


def run_cli(
    argv: Sequence[str] | None,
    run: Callable[[C.ExperimentConfig, RunOptions], Any],
    **parse_kwargs: Any,
) -> int:
    """Parse, validate and run; every expected failure is one line on stderr and a documented exit
    status (the module docstring; docs/reliability.md), never a traceback.

    A process of a multi-process run (``MAGE_DISTRIBUTED=1``, docs/scaling.md) joins it first. In a
    command's own process, once the run has ended, a signal during the interpreter's exit ends it at
    once (``signals.hold_until_exit``)."""
    initialize_from_environment()
    code = _run_cli(argv, run, **parse_kwargs)
    hold_until_exit(code)
    return code


def _run_cli(argv: Sequence[str] | None, run: Callable[[C.ExperimentConfig, RunOptions], Any],
             **parse_kwargs: Any) -> int:
    options: RunOptions | None = None
    try:
        parsed = parse_command_line(argv, **parse_kwargs)
        if parsed is None:
            return 0
        cfg, options = parsed
        compilation_cache.enable(cfg.compile.cache_dir)
        result = run(cfg, options)
    except EXPECTED_FAILURES as err:  # ConfigError: also problems only visible once parts are built
        return failure_exit(err, hint=_resume_hint(options, parse_kwargs) if isinstance(err, EnvWorkerError)
                            else "")
    return int(result) if isinstance(result, int) else 0


EXPECTED_FAILURES = (C.ConfigError, TrainingStopped, EnvWorkerError, EvaluationInterrupted, KeyboardInterrupt)
"""What a command reports in one line with its exit status (``failure_exit``) instead of a traceback."""


def failure_exit(err: BaseException, *, hint: str = "",
                 interrupted: str = "interrupted before the run started: nothing was saved") -> int:
    """Print the one line of an expected failure (``EXPECTED_FAILURES``) and return its exit status:
    ConfigError 2, TrainingStopped 3, EnvWorkerError 4 (``hint``: how to continue), an interrupted
    evaluation 75, a Ctrl-C before any handler of the run was set 130 (the line ``interrupted``)."""
    if isinstance(err, KeyboardInterrupt):
        print(interrupted, file=sys.stderr)
        return EXIT_SECOND_INTERRUPT
    if isinstance(err, EvaluationInterrupted):
        print(err, file=sys.stderr)
        return EXIT_INTERRUPTED
    code = {C.ConfigError: EXIT_CONFIG_ERROR, TrainingStopped: EXIT_TRAINING_STOPPED,
            EnvWorkerError: EXIT_ENVIRONMENT_FAILED}
    print(f"error: {err}{hint}", file=sys.stderr)
    return next(c for kind, c in code.items() if isinstance(err, kind))


def run_command(body: Callable[[], int], *,
                interrupted: str = "interrupted: stopped at once; finished runs are kept") -> int:
    """A command that is not one run (``table1``, the ablations): ``body``'s status, every expected
    failure one line (``failure_exit``), and in the command's own process a signal during its exit ends
    it at once (``signals.hold_until_exit``)."""
    try:
        code = body()
    except EXPECTED_FAILURES as err:
        code = failure_exit(err, interrupted=interrupted)
    hold_until_exit(code)
    return code


def _resume_hint(options: RunOptions | None, parse_kwargs: Mapping[str, Any]) -> str:
    """How to continue a run that an environment failure stopped (nothing after its last checkpoint was
    saved); empty when the run never wrote its config."""
    if options is None or not os.path.isfile(os.path.join(options.run_dir, C.CONFIG_FILE)):
        return ""
    return (f"; nothing after the last checkpoint was saved; continue with: python -m experiments."
            f"{parse_kwargs.get('experiment')} --run-dir {options.run_dir} --resume")
