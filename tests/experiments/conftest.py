"""Fixtures of the experiment tests: a compilation cache shared by the end-to-end runs, the smoke run
settings (``mage_jax.testing.SMOKE``), and a tiny random Hugging Face Qwen3 model + tokenizer folder
built locally."""

from __future__ import annotations

import os
import signal

import pytest

from mage_jax import testing
from mage_jax.logging import read_jsonl
from mage_jax.testing import SMALLEST_DECODER, build_bpe_tokenizer, random_causal_lm
from mage_jax.training import trainer as trainer_module
from tests.optional import require

TIMING = {"time", "wall_seconds", "rollout_seconds", "update_seconds", "iteration_seconds", "rows_per_second",
          "compile/programs", "compile/seconds", "compile/cache_hits"}
"""What differs between two runs of one config: timings, and what compiling took (a process that compiled
a program once does not compile it again)."""


def comparable(run_dir) -> list[dict]:
    """A run's metric records without their timings: what two runs of one config must share on CPU."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_jsonl(str(run_dir))]


def sigterm_after_iteration(monkeypatch, iteration: int) -> None:
    """Send SIGTERM right after ``iteration`` has trained (a handled stop: checkpoint, exit 75);
    ``monkeypatch.undo()`` removes the hook before resuming."""
    original = trainer_module.Trainer.train_iteration

    def train_iteration(self, at):
        metrics = original(self, at)
        if at == iteration:
            os.kill(os.getpid(), signal.SIGTERM)
        return metrics

    monkeypatch.setattr(trainer_module.Trainer, "train_iteration", train_iteration)


@pytest.fixture
def smoke_args():
    """Function: the smoke settings as command-line arguments (plus optional extra overrides)."""
    return testing.smoke_args


@pytest.fixture(scope="session")
def compilation_cache(tmp_path_factory):
    """A persistent XLA cache for the end-to-end runs (and for notebook kernels started from them): they
    build the same programs again and again, and compiling dominates their time. The suite's cache
    (``tests/conftest.py``) when it is on, else one for this session."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    from tests.conftest import SUITE_CACHE

    if SUITE_CACHE is not None:
        yield SUITE_CACHE
        return
    path = str(tmp_path_factory.mktemp("xla_cache"))
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    old = {name: getattr(jax.config, name) for name in names}
    env = {
        "MAGE_COMPILATION_CACHE": path,
        "JAX_COMPILATION_CACHE_DIR": path,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    old_env = {k: os.environ.get(k) for k in env}
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    cc.reset_cache()
    os.environ.update(env)
    yield path
    for name, value in old.items():
        jax.config.update(name, value)
    cc.reset_cache()
    for k, v in old_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# ------------------------------------------------------------------------------------------------
# a tiny random Hugging Face model folder


def _corpus() -> list[str]:
    """Prompt text of both games, so that the byte-level BPE compresses prompts a little."""
    from mage_jax.envs.kuhn_poker import KUHN_PROMPT_SPEC
    from mage_jax.envs.tic_tac_toe import TIC_TAC_TOE_PROMPT_SPEC

    return [
        KUHN_PROMPT_SPEC.preamble,
        TIC_TAC_TOE_PROMPT_SPEC.preamble,
        "Your Card: Queen | Actions: Player 0: Pass -> Player 1: Bet",
        ". X .\nO . .\n. . X",
        "<action>PASS</action> <action>BET</action> <action>(1, 2)</action> <remark>plan</remark>",
        "Currently on trial #2. On trial #1 the task was NOT successfully completed. Your reflection:",
    ]


def build_hf_model_folder(path) -> str:
    """A byte-level BPE tokenizer with a Qwen3-style chat template and a 1-layer random Qwen3 model."""
    from mage_jax.models.config import ModelConfig

    tok = build_bpe_tokenizer(path, _corpus() * 8, vocab_size=800)
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    vocab_size = -(-len(tok) // 8) * 8
    # Qwen3's context, so that the pretrained presets' lengths pass the context check unchanged.
    config = ModelConfig.preset("tiny", vocab_size=vocab_size, **SMALLEST_DECODER,
                                max_position_embeddings=40960)
    hf_config = {**config.to_hf_config(), "eos_token_id": eos[0], "pad_token_id": eos[1]}
    require("torch")
    random_causal_lm(hf_config, path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory) -> str:
    return build_hf_model_folder(tmp_path_factory.mktemp("tiny_qwen3"))
