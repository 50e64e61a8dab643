"""Text <-> token ids: a local Hugging Face tokenizer with its chat template, or a built-in word-level one.

Every LLM call of MAGE is one fresh user message (no system message), so ``encode_prompts`` renders
each prompt as exactly that with the model's chat template (Qwen3: the ``enable_thinking`` switch is
passed to the template). Small models trained from scratch use a word-level vocabulary built from the
environments' own texts: its "chat template" is the identity plus a BOS token. Nothing is downloaded:
HF folders are read with ``local_files_only`` and never with remote code.

The word-level pre-tokenizer drops spaces and keeps newlines, words, numbers, single punctuation
marks and whole XML-like tags (``<action>``, ``</action>``) as tokens, so ``<action>PASS</action>``
is three tokens. Spaces are not stored; ``decode`` re-joins the pieces with punctuation rules that
give back canonical action strings exactly (``<action>PASS</action>``, ``(1, 2)``, ``search[red shoe]``).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

META_FILE = "mage_tokenizer.json"
TOKENIZER_FILE = "tokenizer.json"

PAD, UNK, BOS, EOS = "[PAD]", "[UNK]", "[BOS]", "[EOS]"
WORD_LEVEL_SPECIALS = (PAD, UNK, BOS, EOS)

# Tags, numbers (with decimals), words, newlines, then any other single non-space character.
WORD_PATTERN = r"</?[A-Za-z_][A-Za-z0-9_\-]*>|\d+(?:\.\d+)?|\w+|\n|[^\w\s]"
# Spaces and tabs separate words and are dropped; newlines are kept as tokens.
SPACE_PATTERN = r"[^\S\n]+"

# End-of-turn markers of common chat families; any of them present in the vocabulary stops generation.
_KNOWN_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "</s>")

_NO_SPACE_BEFORE = frozenset(",.;:!?%)]}\n'-/")
_NO_SPACE_AFTER = frozenset("([{\n#$'-/")


class TokenizerError(ValueError):
    """A tokenizer folder or file that cannot be used (missing, malformed, wrong kind)."""


def join_word_pieces(pieces: Sequence[str]) -> str:
    """Join word-level pieces into text: spaces between words, none around brackets, tags and punctuation.

    The rules are exact for canonical action strings and sensible for prose; original spacing is not stored.
    """
    out: list[str] = []
    prev = ""
    for piece in pieces:
        if not piece:
            continue
        if out and not _glues_left(prev, piece):
            out.append(" ")
        out.append(piece)
        prev = piece
    return "".join(out)


def _is_open_tag(piece: str) -> bool:
    return len(piece) > 2 and piece[0] == "<" and piece[-1] == ">" and piece[1] != "/"


def _is_close_tag(piece: str) -> bool:
    return len(piece) > 3 and piece.startswith("</") and piece[-1] == ">"


def _glues_left(prev: str, piece: str) -> bool:
    """Whether ``piece`` attaches to ``prev`` without a space."""
    if piece in _NO_SPACE_BEFORE or _is_close_tag(piece) or piece == "[":
        return True
    return prev in _NO_SPACE_AFTER or _is_open_tag(prev)


@dataclasses.dataclass
class Tokenizer:
    """One tokenizer for the whole run: HF (pretrained models) or word-level (from-scratch models).

    Use the constructors ``from_hf_dir``, ``word_level`` and ``load``; the fields are internal.
    """

    kind: str  # "hf" | "word_level"
    backend: Any  # transformers.PreTrainedTokenizerBase | tokenizers.Tokenizer
    eos_ids: tuple[int, ...]
    pad_id: int
    bos_id: int | None = None
    enable_thinking: bool = True
    source: str | None = None

    # ----------------------------------------------------------------------------------- construction
    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike, *, enable_thinking: bool = True) -> Tokenizer:
        """Load the tokenizer (and chat template) of a local Hugging Face model folder; never downloads."""
        folder = Path(path)
        if not folder.is_dir():
            raise TokenizerError(f"tokenizer folder {str(folder)!r} does not exist")
        _refuse_remote_code(folder)
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
        except Exception as err:  # transformers raises many error types for unusable folders
            raise TokenizerError(
                f"cannot load a Hugging Face tokenizer from {str(folder)!r}: {err}"
            ) from None
        if not getattr(hf, "chat_template", None):
            raise TokenizerError(f"the tokenizer in {str(folder)!r} has no chat template")
        _warn_if_no_thinking_switch(str(hf.chat_template), folder, enable_thinking)
        eos_ids = _hf_stop_ids(hf, folder)
        if not eos_ids:
            raise TokenizerError(f"the tokenizer in {str(folder)!r} defines no end-of-sequence token")
        pad_id = hf.pad_token_id if hf.pad_token_id is not None else eos_ids[0]
        return cls(
            kind="hf",
            backend=hf,
            eos_ids=eos_ids,
            pad_id=int(pad_id),
            bos_id=hf.bos_token_id,
            enable_thinking=enable_thinking,
            source=str(folder),
        )

    @classmethod
    def word_level(
        cls, corpus: Iterable[str], *, vocab_size: int = 8192, min_frequency: int = 1
    ) -> Tokenizer:
        """Build a word-level vocabulary from ``corpus`` (the environments' prompts and action strings).

        The most frequent words win when the corpus has more than ``vocab_size`` distinct words; other
        words encode to [UNK]. Special tokens take ids 0..3: [PAD], [UNK], [BOS], [EOS].
        """
        from tokenizers import Tokenizer as RawTokenizer
        from tokenizers import models, trainers

        if vocab_size <= len(WORD_LEVEL_SPECIALS):
            raise TokenizerError(f"vocab_size must exceed {len(WORD_LEVEL_SPECIALS)}, got {vocab_size}")
        raw = RawTokenizer(models.WordLevel(vocab={}, unk_token=UNK))
        raw.pre_tokenizer = _word_pre_tokenizer()
        trainer = trainers.WordLevelTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(WORD_LEVEL_SPECIALS)
        )
        raw.train_from_iterator((str(text) for text in corpus), trainer=trainer)
        if raw.get_vocab_size() <= len(WORD_LEVEL_SPECIALS):
            raise TokenizerError("the word-level corpus is empty: pass the environments' prompts and actions")
        return cls._from_raw_word_level(raw, source=None)

    @classmethod
    def _from_raw_word_level(cls, raw: Any, *, source: str | None) -> Tokenizer:
        ids = {tok: raw.token_to_id(tok) for tok in WORD_LEVEL_SPECIALS}
        missing = [tok for tok, i in ids.items() if i is None]
        if missing:
            raise TokenizerError(f"word-level tokenizer lacks the special tokens {missing}")
        return cls(
            kind="word_level",
            backend=raw,
            eos_ids=(ids[EOS],),
            pad_id=ids[PAD],
            bos_id=ids[BOS],
            enable_thinking=False,
            source=source,
        )

    # -------------------------------------------------------------------------------------- save/load
    def save(self, directory: str | os.PathLike) -> None:
        """Write the tokenizer so that ``Tokenizer.load(directory)`` rebuilds it exactly."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        if self.kind == "word_level":
            self.backend.save(str(folder / TOKENIZER_FILE))
        else:
            self.backend.save_pretrained(str(folder))
        meta = {
            "kind": self.kind,
            "enable_thinking": self.enable_thinking,
            "eos_ids": list(self.eos_ids),
            "pad_id": self.pad_id,
            "source": self.source,
        }
        (folder / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")

    def save_hf(self, directory: str | os.PathLike) -> None:
        """Write files that ``transformers.AutoTokenizer.from_pretrained(directory)`` loads as this tokenizer.

        HF tokenizers save themselves. The word-level one becomes a ``PreTrainedTokenizerFast``: the
        same vocabulary and pre-tokenizer, a post-processor that prepends [BOS] (so ``tokenizer(text)``
        gives exactly ``encode_prompts([text])[0]``), a chat template that renders one user message as
        its text, and a decoder that re-joins pieces with the rules of ``join_word_pieces``.
        """
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        if self.kind == "hf":
            self.backend.save_pretrained(str(folder))
            return
        from tokenizers import Tokenizer as RawTokenizer
        from tokenizers import processors
        from transformers import PreTrainedTokenizerFast

        raw = RawTokenizer.from_str(self.backend.to_str())
        raw.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, self.bos_id)])
        raw.decoder = _word_decoder()
        hf = PreTrainedTokenizerFast(
            tokenizer_object=raw, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
            chat_template="{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}",
        )
        hf.save_pretrained(str(folder))

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Tokenizer:
        """Load a tokenizer written by ``save`` (or a plain HF model folder, which has no meta file)."""
        folder = Path(directory)
        meta_path = folder / META_FILE
        if not meta_path.exists():
            return cls.from_hf_dir(folder)
        try:
            meta = json.loads(meta_path.read_text())
            kind = meta["kind"]
        except (ValueError, KeyError, TypeError) as err:
            raise TokenizerError(f"malformed tokenizer meta file {str(meta_path)!r}: {err}") from None
        if kind == "hf":
            tok = cls.from_hf_dir(folder, enable_thinking=bool(meta.get("enable_thinking", True)))
            if meta.get("eos_ids"):
                tok.eos_ids = tuple(int(i) for i in meta["eos_ids"])
            return tok
        if kind != "word_level":
            raise TokenizerError(f"unknown tokenizer kind {kind!r} in {str(meta_path)!r}")
        from tokenizers import Tokenizer as RawTokenizer

        try:
            raw = RawTokenizer.from_file(str(folder / TOKENIZER_FILE))
        except Exception as err:
            raise TokenizerError(f"cannot read {str(folder / TOKENIZER_FILE)!r}: {err}") from None
        return cls._from_raw_word_level(raw, source=str(folder))

    # ------------------------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (the model's embedding may be larger)."""
        if self.kind == "word_level":
            return self.backend.get_vocab_size()
        return len(self.backend)

    def token_to_id(self, token: str) -> int | None:
        if self.kind == "word_level":
            return self.backend.token_to_id(token)
        return self.backend.get_vocab().get(token)

    def single_token_id(self, word: str) -> int | None:
        """The id of ``word`` when it encodes to exactly one token that is not [UNK]; else None
        (a constrained reflection's words must each be one token)."""
        ids = self.encode(word)
        unk = (self.token_to_id(UNK) if self.kind == "word_level"
               else getattr(self.backend, "unk_token_id", None))
        return ids[0] if len(ids) == 1 and ids[0] != unk else None

    # ---------------------------------------------------------------------------------------- encode
    def render_prompt(self, text: str) -> str:
        """The chat-formatted text of one prompt (one user message, generation prompt appended)."""
        if self.kind == "word_level":
            return text
        return self.backend.apply_chat_template(
            [{"role": "user", "content": text}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=self.enable_thinking,
        )

    def encode_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each prompt with the chat template applied (word-level: BOS + words)."""
        if self.kind == "word_level":
            # one batched call of the Rust tokenizer, not one call per prompt
            encoded = self.backend.encode_batch(list(texts), add_special_tokens=False)
            return [[self.bos_id, *e.ids] for e in encoded]
        rendered = [self.render_prompt(text) for text in texts]
        # The rendered template already holds every special token; none may be added again.
        return [list(ids) for ids in self.backend(rendered, add_special_tokens=False)["input_ids"]]

    def encode(self, text: str) -> list[int]:
        """Token ids of raw text, no template and no special tokens (e.g. an action string)."""
        if self.kind == "word_level":
            return list(self.backend.encode(text, add_special_tokens=False).ids)
        return list(self.backend.encode(text, add_special_tokens=False))

    # ---------------------------------------------------------------------------------------- decode
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of generated ids; special tokens (EOS, PAD, <|im_end|>) are dropped by default.

        Qwen3's ``<think>``/``</think>`` are ordinary added tokens and stay in the text, since parsing
        runs on the whole response.
        """
        ids = [int(i) for i in ids]
        if self.kind == "hf":
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        specials = set(WORD_LEVEL_SPECIALS) - {UNK}
        pieces = []
        for i in ids:
            piece = self.backend.id_to_token(i)
            if piece is None or (skip_special_tokens and piece in specials):
                continue
            pieces.append(piece)
        return join_word_pieces(pieces)

    def decode_batch(self, batch: Iterable[Sequence[int]], *, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch]


def _word_pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPACE_PATTERN), behavior="removed"),
            pre_tokenizers.Split(Regex(WORD_PATTERN), behavior="isolated"),
        ]
    )


def _word_decoder():
    """``join_word_pieces`` as a ``tokenizers`` decoder: join with spaces, then drop the spaces its rules
    forbid (before closing punctuation, close tags and "[", after opening punctuation and open tags)."""
    from tokenizers import Regex, decoders

    before = "".join(re.escape(c) for c in sorted(_NO_SPACE_BEFORE))
    after = "".join(re.escape(c) for c in sorted(_NO_SPACE_AFTER))
    return decoders.Sequence([
        decoders.WordPiece(prefix="\x00##", cleanup=False),  # a prefix that never occurs: " ".join
        decoders.Fuse(),
        decoders.Replace(Regex(f" (?=[{before}]|</|\\[(?!UNK\\]))"), ""),
        decoders.Replace(Regex(f"(?<=[{after}]) "), ""),
        decoders.Replace(Regex(r"(?<=<[A-Za-z_][A-Za-z0-9_\-]*>) "), ""),
    ])


_WARNED_NO_THINKING_SWITCH: set[str] = set()


def _warn_if_no_thinking_switch(template: str, folder: Path, enable_thinking: bool) -> None:
    """One ``warning:`` line per folder and process when thinking is asked for and the template has no
    ``enable_thinking`` switch (Llama / SmolLM2 ChatML templates; Qwen3's has one), so the request is not
    silently without effect. Thinking off needs no warning: such a template never thinks."""
    key = str(folder.resolve())
    if not enable_thinking or "enable_thinking" in template or key in _WARNED_NO_THINKING_SWITCH:
        return
    _WARNED_NO_THINKING_SWITCH.add(key)
    print(f"warning: the chat template of {str(folder)!r} has no thinking switch: "
          "tokenizer.enable_thinking=true has no effect on its prompts (set it to false to silence this)",
          file=sys.stderr)


def _refuse_remote_code(folder: Path) -> None:
    """A tokenizer that names its own Python classes (``auto_map``) would need remote code: refused.

    transformers would otherwise quietly fall back to a built-in class that may tokenize differently.
    """
    for name, key in (("tokenizer_config.json", None), ("config.json", "AutoTokenizer")):
        path = folder / name
        if not path.is_file():
            continue
        try:
            auto_map = json.loads(path.read_text(encoding="utf-8")).get("auto_map")
        except (ValueError, AttributeError):
            continue  # unreadable files are reported by the loader itself
        if auto_map and (key is None or (isinstance(auto_map, dict) and key in auto_map)):
            raise TokenizerError(
                f"the tokenizer in {str(folder)!r} needs remote code ({name} has an auto_map entry); "
                "remote code is never run: use a folder with a standard tokenizer.json")


def _hf_stop_ids(hf: Any, folder: Path) -> tuple[int, ...]:
    """EOS ids: the tokenizer's eos, generation_config.json's eos_token_id, and known end-of-turn tokens."""
    ids: list[int] = []

    def add(tid: Any) -> None:
        if isinstance(tid, int) and tid >= 0 and tid not in ids:
            ids.append(tid)

    add(hf.eos_token_id)
    gen_cfg = folder / "generation_config.json"
    if gen_cfg.exists():
        try:
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        except (ValueError, AttributeError):
            eos = None
        for tid in eos if isinstance(eos, list) else [eos]:
            add(tid)
    vocab = hf.get_vocab()
    for token in _KNOWN_STOP_TOKENS:
        if token in vocab:
            add(vocab[token])
    return tuple(ids)


class PromptEncoder:
    """``Tokenizer.encode_prompts`` for prompts that extend earlier ones: a meta-episode's prompts share a
    long, growing prefix (the preamble, the task, the history so far), so with the word-level tokenizer
    only the text after the longest prefix shared with an earlier prompt is tokenized.

    Why this is exact: the word-level pre-tokenizer first drops runs of spaces and tabs, then splits
    the rest into tags, numbers, words, single newlines and single other characters, and the
    vocabulary maps each piece to one id on its own (no normalizer, no merges). No piece spans a space,
    a tab or a newline, and no pattern looks behind, so cutting the text right after one of them
    splits its tokens exactly there: ids(a + b) == ids(a) + ids(b). The cut is the last such character
    inside the shared prefix; the earlier prompt's ids up to the cut are reused (their end offsets say
    where). The tokenizer's pre-tokenizer and normalizer are checked to be those at construction;
    any other tokenizer (HF: byte-level BPE merges across spaces) encodes whole texts, as before.

    One per rollout (``LLMPolicy``); it holds at most ``max_prompts`` prompts (then starts over)."""

    _CUTS = (" ", "\t", "\n")

    def __init__(self, tokenizer: Any, max_prompts: int = 4096):
        self.tokenizer = tokenizer
        self.max_prompts = max_prompts
        backend = getattr(tokenizer, "backend", None)
        self.incremental = (
            getattr(tokenizer, "kind", None) == "word_level"
            and backend.normalizer is None
            and backend.pre_tokenizer is not None
            and backend.pre_tokenizer.__getstate__() == _word_pre_tokenizer().__getstate__()
        )
        self.reused_tokens = 0  # ids taken from earlier prompts instead of tokenized again
        self._sorted: list[str] = []  # the prompts held, sorted (the best donor of a text is a neighbour)
        self._held: dict[str, tuple[list[int], list[int]]] = {}  # text -> (ids without BOS, token ends)

    def encode_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each prompt, equal to ``tokenizer.encode_prompts(texts)``."""
        if not self.incremental:
            return self.tokenizer.encode_prompts(texts)
        cuts = [self._cut(text) for text in texts]
        encoded = self.tokenizer.backend.encode_batch([t[c:] for t, (c, _) in zip(texts, cuts)],
                                                      add_special_tokens=False)
        out = []
        for text, (cut, head), e in zip(texts, cuts, encoded):
            ids, ends = head[0] + e.ids, head[1] + [cut + end for _, end in e.offsets]
            self.reused_tokens += len(head[0])
            self._hold(text, ids, ends)
            out.append([self.tokenizer.bos_id, *ids])
        return out

    def _cut(self, text: str) -> tuple[int, tuple[list[int], list[int]]]:
        """Where to start tokenizing ``text`` and the reused (ids, ends) before that point."""
        none: tuple[list[int], list[int]] = ([], [])
        if not self._sorted:
            return 0, none
        i = bisect.bisect_left(self._sorted, text)
        best, shared = None, 0
        for j in (i - 1, i):
            if 0 <= j < len(self._sorted):
                n = _shared_prefix(self._sorted[j], text)
                if n > shared:
                    best, shared = self._sorted[j], n
        if best is None:
            return 0, none
        cut = max(text.rfind(c, 0, shared) for c in self._CUTS) + 1  # right after the last cut character
        if cut <= 0:
            return 0, none
        ids, ends = self._held[best]
        k = bisect.bisect_right(ends, cut)  # the tokens that end at or before the cut
        return cut, (ids[:k], ends[:k])

    def _hold(self, text: str, ids: list[int], ends: list[int]) -> None:
        if text in self._held:
            return
        if len(self._held) >= self.max_prompts:
            self._sorted, self._held = [], {}
        bisect.insort(self._sorted, text)
        self._held[text] = (ids, ends)


def _shared_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (binary search over slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
