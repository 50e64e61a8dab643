"""Tiny tokenizers and random models built locally for tests (nothing is downloaded): the smallest
decoder sizes, a byte-level BPE tokenizer with a Qwen3-style chat template, and random Hugging Face
causal LMs saved as safetensors folders."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.optional import require

SMALLEST_DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 16,
}
"""`ModelConfig` overrides of the smallest decoder the tests run end to end (with the `tiny` preset)."""

# A Qwen3-style template written for these tests: one message list, generation prompt, and an empty
# think block when thinking is switched off (the format Qwen3 uses).
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def build_bpe_tokenizer(path: Path, corpus: Sequence[str], *, vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on ``corpus`` with Qwen-style special tokens and chat template,
    saved to ``path`` with a `generation_config.json` naming both stop tokens; returns the HF tokenizer."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(list(corpus), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN3_STYLE_TEMPLATE,
    )
    hf.add_tokens(["<think>", "</think>"])  # ordinary added tokens, as in Qwen3: kept when decoding
    hf.save_pretrained(str(path))
    eos = [hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")]
    (Path(path) / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return hf


def build_random_causal_lm(
    hf_config: Mapping[str, Any],
    folder: Path | None = None,
    *,
    seed: int = 0,
    weight_std: float | None = None,
) -> Any:
    """A random `transformers` causal LM from a `config.json`-style mapping (with ``model_type``), saved
    to ``folder`` as safetensors when given. ``weight_std`` redraws every matrix from N(0, std²): large
    weights keep logits far apart, so greedy choices are not near-ties."""
    torch = require("torch")
    import transformers

    config = transformers.AutoConfig.for_model(**hf_config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if weight_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 2:
                    p.normal_(0.0, weight_std)
    if folder is not None:
        model.save_pretrained(str(folder), safe_serialization=True)
    return model
