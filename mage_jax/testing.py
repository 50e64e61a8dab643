"""Support code shared by the tests, the benchmarks and the notebooks (one home, so that none of them
imports another's private helpers): the smallest model shapes, the smoke-run settings of the main job,
locally built tokenizers and random Hugging Face models, tiny ALFWorld data, and the engine-parity
harness (a greedy rollout through the rollout engine and through lockstep generation, compared row by
row).

Nothing here is downloaded. ``random_causal_lm`` needs PyTorch (the ``test`` / ``bench`` extras);
``write_tiny_alfworld_data`` needs ``alfworld`` and ``textworld``. Importing this module is cheap (no JAX):
the harness imports the run's parts when it runs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the harness imports JAX and the run's parts when it runs: the constants stay cheap
    from mage_jax import config as C
    from mage_jax.generate.engine import RolloutEngine
    from mage_jax.generate.sampler import Sampler
    from mage_jax.rollout.meta_episode import RolloutResult, RunnerConfig
    from mage_jax.tokenizer import Tokenizer

# ---------------------------------------------------------------------------------------- model shapes
SMALLEST_DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 16,
}
"""``ModelConfig`` overrides of the smallest decoder the tests run end to end (with the ``tiny`` preset)."""

# ----------------------------------------------------------------------------------------- smoke runs
SMOKE = {
    "model.overrides": {**SMALLEST_DECODER, "max_position_embeddings": 2048},
    "rollout.num_tasks": 2,
    "rollout.group_size": 2,
    "rollout.num_episodes": 2,
    "train.eval_num_episodes": 2,
    "train.iterations": 1,
    "train.eval_every": 0,
    "train.eval_meta_episodes": 4,
    "train.eval_heldout_meta_episodes": 4,
    "train.validation_meta_episodes": 4,
    "tokenizer.corpus_meta_episodes": 8,
    "logging.progress": False,
    "logging.plots": False,
    "checkpoint.every": 0,
}
"""The main job's smoke sizes (the quickstart notebook's ``MAGE_SMOKE``, CI's smoke run, the end-to-end
tests): runs of them share compiled programs through the compilation cache."""


def smoke_args(overrides: Mapping[str, Any] | None = None) -> list[str]:
    """``SMOKE`` (and ``overrides``) as ``--set KEY=VALUE`` arguments of a command line (JSON for dicts
    and lists, lower case for booleans)."""
    args = []
    for key, value in {**SMOKE, **(overrides or {})}.items():
        if isinstance(value, (dict, list)):
            text = json.dumps(value)
        else:
            text = str(value).lower() if isinstance(value, bool) else str(value)
        args += ["--set", f"{key}={text}"]
    return args


# -------------------------------------------------------------------------------------------- runners
def runner_config(*, anchor: str = "global", keep_text: bool = False, **rollout: Any) -> RunnerConfig:
    """A ``RunnerConfig`` from keyword arguments: ``anchor`` and ``keep_text`` are the runner's, the rest
    fields of its ``RolloutConfig`` (their defaults otherwise), for tests and benchmarks that build a
    runner without an experiment config."""
    from mage_jax.rollout.config import RolloutConfig
    from mage_jax.rollout.meta_episode import RunnerConfig

    return RunnerConfig(RolloutConfig(**rollout), anchor=anchor, keep_text=keep_text)


# ------------------------------------------------------------------------- tokenizers and random models
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
"""A Qwen3-style chat template written for the tests: one message list, the generation prompt, and an
empty think block when thinking is switched off (the format Qwen3 uses)."""


def build_bpe_tokenizer(path: str | Path, corpus: Sequence[str], *, vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on ``corpus`` with Qwen-style special tokens and chat template,
    saved to ``path`` with a ``generation_config.json`` naming both stop tokens; returns the HF tokenizer."""
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


def random_causal_lm(hf_config: Mapping[str, Any], folder: str | Path | None = None, *, seed: int = 0,
                     weight_std: float | None = None, norm_range: tuple[float, float] | None = None) -> Any:
    """A random ``transformers`` causal LM of a ``config.json``-style mapping (with ``model_type``), in
    eval mode on the CPU, saved to ``folder`` as safetensors when given (our loader reads it back, so both
    sides run identical weights). ``weight_std`` redraws every matrix from N(0, std²): large weights keep
    logits far apart, so greedy choices are not near-ties; ``norm_range`` redraws the vectors (norm
    weights) from U(low, high), so that a mistake in a norm moves the logits too."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**hf_config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2 and weight_std is not None:
                p.normal_(0.0, weight_std)
            elif p.ndim != 2 and norm_range is not None:
                p.uniform_(*norm_range)
    if folder is not None:
        model.save_pretrained(str(folder), safe_serialization=True)
    return model


# ------------------------------------------------------------------------------------------ tiny games
TINY_ALFWORLD_TASKS = ("pick_and_place_simple", "pick_cool_then_place_in_recep")
"""The task types ``envs.alfworld.write_tiny_alfred_game`` writes."""


def write_tiny_alfworld_data(root: str | Path, *, splits: Sequence[str] = ("train",), games: int = 1,
                             trials: int = 1) -> str:
    """An ALFWorld data folder (``root/json_2.1.1/<split>/<task>-Apple-None-Fridge-<k>/trial_T<t>``) of
    ``games`` one-room PDDL games per split (task types alternating over ``TINY_ALFWORLD_TASKS``), each
    with ``trials`` trial folders; returns ``root`` for ``env.data_dir``."""
    from mage_jax.envs.alfworld import write_tiny_alfred_game

    for split in splits:
        for k in range(games):
            task = TINY_ALFWORLD_TASKS[k % len(TINY_ALFWORLD_TASKS)]
            for t in range(1, trials + 1):
                game = Path(root) / "json_2.1.1" / split / f"{task}-Apple-None-Fridge-{k + 1}"
                trial = game / f"trial_T{t}"
                if not trial.exists():
                    write_tiny_alfred_game(trial, task)
    return str(root)


# ------------------------------------------------------------------------------------- engine parity
PARITY_OVERRIDES = {
    "rollout.num_tasks": 2, "rollout.group_size": 2, "rollout.num_episodes": 2, "rollout.max_turns": 3,
    "rollout.max_response_tokens": 12, "rollout.max_reflection_tokens": 6, "rollout.reflect": True,
    "rollout.memory_mode": "history_and_reflection",
    "model.overrides": SMALLEST_DECODER, "tokenizer.corpus_meta_episodes": 4,
    "train.eval_meta_episodes": 4, "train.eval_heldout_meta_episodes": 4,
    "rollout.engine_slots": 3, "rollout.engine_chunk": 2,
}
"""Overrides of an environment's ``tiny`` preset for the engine-parity rollout: 2 x 2 meta-episodes of 2
episodes with reflections, short responses, 3 engine slots (fewer than the rows: turns interleave)."""


@dataclasses.dataclass(frozen=True)
class ParityModel:
    """One word-level tokenizer, random model, lockstep sampler and rollout engine for the parity
    configs of several environments (their programs compile once for all of them)."""

    cfgs: dict[str, C.ExperimentConfig]
    tokenizer: Tokenizer
    sampler: Sampler
    params: Any
    engine: RolloutEngine


def parity_model(cfgs: Mapping[str, C.ExperimentConfig]) -> ParityModel:
    """The model of ``cfgs`` (by environment): a vocabulary of every environment's random-policy prompts,
    one prompt bucket as long as the longest prompt limit, the first config's model and engine."""
    from mage_jax.tokenizer import Tokenizer
    from mage_jax.training import assemble

    corpus = [text for cfg in cfgs.values()
              for text in assemble.tokenizer_corpus(cfg, assemble.make_task_sampler(cfg))]
    tokenizer = Tokenizer.word_level(corpus)
    longest = max(cfg.rollout.max_prompt_tokens for cfg in cfgs.values())
    base = next(iter(cfgs.values()))
    base = dataclasses.replace(base, rollout=dataclasses.replace(
        base.rollout, max_prompt_tokens=longest, length_buckets=(longest,)))
    generation = assemble.build_generation(base, tokenizer, assemble.make_mesh(base), lockstep=True)
    if generation.engine is None or generation.sampler is None:
        raise ValueError("the parity configs run without the rollout engine (rollout.engine=lockstep)")
    return ParityModel(dict(cfgs), tokenizer, generation.sampler, generation.params, generation.engine)


def greedy_rollouts(model: ParityModel, env: str) -> tuple[RolloutResult, RolloutResult]:
    """The greedy training rollout of ``env``'s parity config through lockstep generation and through the
    rollout engine (same tasks, model and prompt limit)."""
    import jax

    from mage_jax.generate.step import SamplingParams
    from mage_jax.rollout.policy import LLMPolicy
    from mage_jax.training import assemble

    cfg = model.cfgs[env]
    r = cfg.rollout
    greedy = SamplingParams(temperature=0.0, max_new_tokens=r.max_new_tokens)
    tasks = assemble.make_task_sampler(cfg).sample_train(0)
    runner = assemble.make_runner(cfg, num_episodes=r.num_episodes)
    out = []
    for generator in (model.sampler, model.engine):
        policy = LLMPolicy(model.tokenizer, generator, model.params, greedy, jax.random.key(0),
                           max_prompt_tokens=r.max_prompt_tokens)
        out.append(runner.run(tasks, policy, training=True))
    return out[0], out[1]


TIMING_STATS = frozenset({"rollout_seconds"})
"""Rollout statistics that measure time, not what was generated."""


def rollout_differences(a: RolloutResult, b: RolloutResult, *, logprob_atol: float = 1e-5) -> list[str]:
    """Where rollout ``b`` differs from ``a``: every field of every row (log-probs within
    ``logprob_atol``; the constraint automaton objects are not compared), the outcomes and the rollout
    statistics other than timings. Empty when they agree (and neither is empty)."""
    found = [] if len(a.rows) == len(b.rows) > 0 else [f"rows: {len(a.rows)} and {len(b.rows)}"]
    for i, (ra, rb) in enumerate(zip(a.rows, b.rows)):
        for field in dataclasses.fields(ra):
            va, vb = getattr(ra, field.name), getattr(rb, field.name)
            if field.name == "logprobs":
                same = np.shape(va) == np.shape(vb) and np.allclose(va, vb, atol=logprob_atol, rtol=0)
            elif isinstance(va, np.ndarray):
                same = np.array_equal(va, vb)
            else:
                same = field.name == "constraint" or va == vb
            if not same:
                found.append(f"row {i}: {field.name}")
    if [o.to_dict() for o in a.outcomes] != [o.to_dict() for o in b.outcomes]:
        found.append("outcomes")
    stats_a, stats_b = ({k: v for k, v in s.stats.items() if k not in TIMING_STATS} for s in (a, b))
    if stats_a != stats_b:
        found.append("stats: " + ", ".join(sorted(k for k in stats_a.keys() | stats_b.keys()
                                                  if stats_a.get(k) != stats_b.get(k))))
    return found
