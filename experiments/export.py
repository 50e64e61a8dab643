"""Export a trained checkpoint as a Hugging Face model folder, or a LoRA run's adapters alone.

    python -m experiments.export --run-dir runs/kuhn_poker/RUN --best --out-dir DIR [--KEY VALUE ...]
    python -m experiments.export --run-dir runs/kuhn_poker/RUN --adapter kuhn_lora_adapter.safetensors

``--adapter FILE`` (a LoRA run: ``model.lora_rank`` > 0) writes only the adapter matrices, a few MB, to
one ``.safetensors`` file (``mage_jax.models.adapter_file``) with the run's config, iteration and
evaluation key in its metadata: ``python -m experiments.evaluate --model-path BASE --adapter FILE``
puts them on the base model folder again and replays the run's evaluation (``--set`` changes keys,
e.g. ``env.eval_seed``). Its name must end in ``.safetensors`` and say ``adapter`` or ``lora``, so a
reader never mistakes it for a model.

``--best`` exports the best validated state (``checkpoints_best/``, kept when ``train.validate_every``
> 0): the state the run's final evaluation and ``summary.json`` measure. Without it the latest
checkpoint (or ``--step K``) is exported, and a run that has a best state says so.

The folder holds ``config.json`` (with the eos / pad / bos token ids), ``generation_config.json``,
the weights as safetensors and the run's tokenizer files, so that
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)``
load it and ``generate`` stops at the run's end-of-turn tokens. A run trained from scratch has the
built-in word-level tokenizer; it is written as a ``PreTrainedTokenizerFast`` that encodes prompts
exactly as training did. A missing run, step or best state, or a non-empty ``--out``, is one
``error:`` line (exit 2).

Keys of the run's config may be overridden as in training (``--model.overrides.scan_layers false``,
``--set KEY=VALUE``). A checkpoint whose decoder blocks are in another layout than the one the run's
config gives today (one block per layer, saved before its preset scanned them) is an error line that
names the override which restores it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from experiments.common import EXIT_CONFIG_ERROR, ConfigErrorParser, split_dotted
from mage_jax import config as C
from mage_jax.models.adapter_file import save_adapters
from mage_jax.models.hf_loading import export_hf
from mage_jax.training.assemble import best_checkpoint_dir, build_parts, checkpoint_dir
from mage_jax.training.checkpoint import Checkpointer

ADAPTER_SUFFIX = ".safetensors"
ADAPTER_WORDS = ("adapter", "lora")


@dataclasses.dataclass(frozen=True)
class ExportResult:
    out_dir: str
    iteration: int
    num_params: int
    best: bool
    """The exported state is the best validated one."""
    best_iteration: int | None
    """The run's best validated iteration (None: the run kept none)."""


def _parser() -> argparse.ArgumentParser:
    p = ConfigErrorParser(prog="python -m experiments.export", description=__doc__.split("\n\n")[0],
                          allow_abbrev=False)
    p.add_argument("--run-dir", required=True, help="a training run directory (config.json, checkpoints/)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--best", action="store_true",
                       help="export the best validated state (checkpoints_best/): what summary.json measures")
    which.add_argument("--step", type=int, default=None,
                       help="checkpoint step (default: the latest intact one)")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--out-dir", "--out", dest="out_dir",
                     help="the new Hugging Face model folder (must not hold files)")
    out.add_argument("--adapter", help="write the LoRA adapters alone to this .safetensors file (a LoRA run)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the run's config (repeatable); --KEY VALUE works too")
    return p


def _best_iteration(directory: str) -> int | None:
    """The step of the best validated state kept in ``directory`` (None: none is kept)."""
    if not os.path.isdir(directory):
        return None
    with Checkpointer(directory) as ckpt:
        return ckpt.latest_step()


def check_adapter_name(path: str) -> None:
    """One ConfigError unless ``path`` ends in ``.safetensors`` and its name says adapter or lora."""
    name = os.path.basename(path).lower()
    if not name.endswith(ADAPTER_SUFFIX) or not any(word in name for word in ADAPTER_WORDS):
        raise C.ConfigError(f"--adapter {path!r}: the file name must end in {ADAPTER_SUFFIX} and contain "
                            f"{' or '.join(ADAPTER_WORDS)} (e.g. kuhn_lora_adapter.safetensors)")


def export_run(run_dir: str, out_dir: str | None = None, *, step: int | None = None, best: bool = False,
               overrides: dict[str, Any] | None = None, adapter: str | None = None) -> ExportResult:
    """Write the parameters of ``run_dir``'s checkpoint ``step`` (default: latest; ``best``: its best
    validated state) and its tokenizer to ``out_dir``, or (``adapter``) its LoRA adapters alone to that
    file; ``overrides`` change keys of the run's config first."""
    if not os.path.isfile(os.path.join(run_dir, C.CONFIG_FILE)):
        raise C.ConfigError(f"--run-dir {run_dir!r} holds no {C.CONFIG_FILE}; pass a training run directory")
    if adapter is not None:
        check_adapter_name(adapter)
        if os.path.exists(adapter):
            raise C.ConfigError(f"--adapter {adapter!r} already exists")
    elif os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise C.ConfigError(f"--out-dir {out_dir!r} already exists and is not an empty folder")
    cfg = C.apply_overrides(C.load(run_dir), overrides or {})
    if adapter is not None and cfg.model.lora_rank <= 0:
        raise C.ConfigError(f"--adapter: the run {run_dir!r} trained no LoRA adapters (model.lora_rank is "
                            "0); export it as a model folder with --out-dir")
    C.validate(cfg)
    best_dir = best_checkpoint_dir(cfg, run_dir)
    best_iteration = _best_iteration(best_dir)
    if best and best_iteration is None:
        raise C.ConfigError(f"--best: {run_dir!r} has no best validated state ({best_dir!r} holds no "
                            "checkpoint; a run keeps one when train.validate_every > 0)")
    parts = build_parts(cfg, run_dir)  # the run's own tokenizer and model shapes
    params, meta = parts.restore_params(best_dir if best else checkpoint_dir(cfg, run_dir), step)
    iteration = int(meta.get("iteration", 0))
    if adapter is not None:
        record = {"config": json.dumps(C.to_dict(cfg)), "iteration": str(iteration),
                  "base_model": os.path.basename(os.path.normpath(cfg.model.path or ""))}
        if "rng" in meta:
            record["rng"] = json.dumps(meta["rng"])
        os.makedirs(os.path.dirname(os.path.abspath(adapter)), exist_ok=True)
        save_adapters(adapter, params, parts.model_config, metadata=record)
        return ExportResult(out_dir=adapter, iteration=iteration,
                            num_params=int(parts.model_config.num_params()), best=best,
                            best_iteration=best_iteration)
    tok = parts.tokenizer
    export_hf(params, parts.model_config, out_dir, eos_token_ids=tok.eos_ids, pad_token_id=tok.pad_id,
              bos_token_id=tok.bos_id)
    tok.save_hf(out_dir)
    return ExportResult(out_dir=out_dir, iteration=iteration,
                        num_params=int(parts.model_config.num_params()), best=best,
                        best_iteration=best_iteration)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        dotted, rest = split_dotted(argv)
        try:
            args = _parser().parse_args(rest)
        except SystemExit:  # --help
            return 0
        overrides = dict([C.parse_assignment(s) for s in args.sets] + dotted)
        result = export_run(args.run_dir, args.out_dir, step=args.step, best=args.best, overrides=overrides,
                            adapter=args.adapter)
    except C.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    state = "the best validated state, " if result.best else ""
    what = "the LoRA adapters of " if args.adapter else ""
    print(f"exported {what}{state}iteration {result.iteration} ({result.num_params:,} parameters) of "
          f"{args.run_dir} to {result.out_dir}")
    if not result.best and result.best_iteration is not None and result.best_iteration != result.iteration:
        print(f"note: the run's final evaluation (summary.json) measured its best validated state, iteration "
              f"{result.best_iteration}; export that one with --best")
    return 0


if __name__ == "__main__":
    sys.exit(main())
