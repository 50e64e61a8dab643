"""Export a trained checkpoint as a Hugging Face model folder.

    python -m experiments.export --run-dir runs/kuhn_poker/RUN [--step K] --out-dir DIR

The folder holds ``config.json`` (with the eos / pad / bos token ids), ``generation_config.json``,
the weights as safetensors and the run's tokenizer files, so that
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)``
load it and ``generate`` stops at the run's end-of-turn tokens. A run trained from scratch has the
built-in word-level tokenizer; it is written as a ``PreTrainedTokenizerFast`` that encodes prompts
exactly as training did. A missing run, step or a non-empty ``--out`` is one ``error:`` line (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from experiments.common import EXIT_CONFIG_ERROR, ConfigErrorParser
from mage_jax import config as C
from mage_jax.models.hf_loading import export_hf
from mage_jax.training.assemble import build_parts, checkpoint_dir


@dataclasses.dataclass(frozen=True)
class ExportResult:
    out_dir: str
    iteration: int
    num_params: int


def _parser() -> argparse.ArgumentParser:
    p = ConfigErrorParser(prog="python -m experiments.export", description=__doc__.split("\n\n")[0],
                          allow_abbrev=False)
    p.add_argument("--run-dir", required=True, help="a training run directory (config.json, checkpoints/)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest intact one)")
    p.add_argument("--out-dir", "--out", dest="out_dir", required=True,
                   help="the new Hugging Face model folder (must not hold files)")
    return p


def export_run(run_dir: str, out_dir: str, *, step: int | None = None) -> ExportResult:
    """Write the parameters of ``run_dir``'s checkpoint ``step`` (default: latest) and its tokenizer."""
    if not os.path.isfile(os.path.join(run_dir, C.CONFIG_FILE)):
        raise C.ConfigError(f"--run-dir {run_dir!r} holds no {C.CONFIG_FILE}; pass a training run directory")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise C.ConfigError(f"--out-dir {out_dir!r} already exists and is not an empty folder")
    cfg = C.load(run_dir)
    parts = build_parts(cfg, run_dir)  # the run's own tokenizer and model shapes
    params, meta = parts.restore_params(checkpoint_dir(cfg, run_dir), step)
    tok = parts.tokenizer
    export_hf(params, parts.model_config, out_dir, eos_token_ids=tok.eos_ids, pad_token_id=tok.pad_id,
              bos_token_id=tok.bos_id)
    tok.save_hf(out_dir)
    return ExportResult(out_dir=out_dir, iteration=int(meta.get("iteration", 0)),
                        num_params=int(parts.model_config.num_params()))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            args = _parser().parse_args(argv)
        except SystemExit:  # --help
            return 0
        result = export_run(args.run_dir, args.out_dir, step=args.step)
    except C.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(f"exported iteration {result.iteration} ({result.num_params:,} parameters) of {args.run_dir} "
          f"to {result.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
