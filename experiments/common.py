"""Command-line plumbing shared by the experiment modules: presets, overrides, run directories.

Every experiment module (``python -m experiments.<name>``) accepts the same flags:

    --preset NAME            start from a named preset of the experiment (default: the module's)
    --config FILE            start from a saved config.json instead of a preset
    --set KEY=VALUE          override one config key (repeatable), e.g. --set optim.lr=1e-3
    --KEY VALUE / --KEY=VALUE  the same, e.g. --optim.lr 1e-3 --rollout.reflect false
    --run-dir DIR            where the run writes (default runs/<experiment>/<timestamp>)
    --model-path DIR         shorthand for --model.path DIR (a local Hugging Face folder)
    --resume                 continue the run in --run-dir from its latest checkpoint
    --list-keys              print every config key and exit

Every problem with the command line or the resulting config is reported as ONE line on stderr
(``error: ...``) with exit status 2, before anything is written. Exit status of a run: 0 finished;
3 stopped because training cannot make progress (one ``error:`` line); 75 interrupted by SIGTERM or
Ctrl-C (checkpoint saved, the ``--resume`` command printed); 130 a second Ctrl-C (nothing saved).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mage_jax import config as C
from mage_jax.training.trainer import TrainingStopped

EXIT_CONFIG_ERROR = 2
EXIT_TRAINING_STOPPED = 3
"""The run stopped because it cannot make progress (``TrainingStopped``: updates keep being skipped, or
an iteration has no valid row); one ``error:`` line names the cause and the last checkpoint."""
EXIT_INTERRUPTED = 75
"""SIGTERM / SIGINT: a checkpoint was saved and the exact ``--resume`` command printed (EX_TEMPFAIL: a
scheduler may simply run that command again). A second Ctrl-C exits at once with 130, saving nothing."""


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
            default_preset: str) -> ConfigErrorParser:
    p = ConfigErrorParser(prog=prog, description=description, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="Config keys take --KEY VALUE or --set KEY=VALUE, e.g. --optim.lr 1e-3 "
                       "(list them with --list-keys). Presets: "
                       + "; ".join(f"{k}: {v.description}" for k, v in presets.items()))
    p.add_argument("--preset", choices=sorted(presets), default=None,
                   help=f"named preset (default: {default_preset})")
    p.add_argument("--config", default=None, help="start from this config.json instead of a preset")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--run-dir", default=None, help="run directory (default runs/<experiment>/<timestamp>)")
    p.add_argument("--model-path", default=None, help="local Hugging Face model folder (= --model.path)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its latest checkpoint")
    p.add_argument("--list-keys", action="store_true", help="print every config key and exit")
    return p


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
) -> tuple[C.ExperimentConfig, RunOptions] | None:
    """Build and validate the config of a command line; ConfigError on any problem.

    Returns None when the command only asked for information (``--list-keys``, ``--help``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    dotted, rest = split_dotted(argv)
    parser = _parser(f"python -m experiments.{experiment}", description, presets, default_preset)
    try:
        args = parser.parse_args(rest)
    except SystemExit:  # --help
        return None
    if args.list_keys:
        print("\n".join(C.all_keys()))
        return None
    overrides: list[tuple[str, str]] = [C.parse_assignment(s) for s in args.sets] + dotted
    if args.model_path is not None:
        overrides.append(("model.path", args.model_path))

    run_dir = args.run_dir
    if args.resume:
        if run_dir is None:
            raise C.ConfigError("--resume needs --run-dir DIR (the run to continue)")
        if not os.path.isfile(os.path.join(run_dir, C.CONFIG_FILE)):
            raise C.ConfigError(f"--resume: {run_dir!r} holds no {C.CONFIG_FILE}; nothing to resume")
        if args.preset is not None or args.config is not None:
            raise C.ConfigError("--resume continues the run's saved config; drop --preset / --config")
        cfg = C.load(run_dir)
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
    cfg = C.apply_overrides(cfg, dict(overrides) if len({k for k, _ in overrides}) == len(overrides)
                            else _ordered(overrides))
    if run_dir is None:
        run_dir = cfg.logging.run_dir or default_run_dir(experiment)
    cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, run_dir=run_dir))
    if preset_name is not None:
        presets[preset_name].check(preset_name, cfg)
    C.validate(cfg)
    if not args.resume and os.path.exists(os.path.join(run_dir, C.CONFIG_FILE)):
        raise C.ConfigError(f"run directory {run_dir!r} already holds a run; pass --resume to continue it "
                            "or choose another --run-dir")
    return cfg, RunOptions(preset=preset_name, run_dir=run_dir, resume=bool(args.resume))


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
    """Parse, validate and run; configuration problems print one ``error:`` line and return 2."""
    try:
        parsed = parse_command_line(argv, **parse_kwargs)
    except C.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if parsed is None:
        return 0
    cfg, options = parsed
    try:
        result = run(cfg, options)
    except C.ConfigError as err:  # problems only visible once parts are built (e.g. mesh vs devices)
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except TrainingStopped as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_TRAINING_STOPPED
    return int(result) if isinstance(result, int) else 0
