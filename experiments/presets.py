"""The three scales of every environment experiment, and the registry of environment experiments.

Scales (``--preset``):

* ``tiny`` — a 2-layer Qwen3-architecture decoder trained FROM SCRATCH on a CPU with the built-in
  word-level tokenizer, compact prompts, constrained actions and trajectory memory (no reflections:
  a random network cannot write them). Minutes per run; it exercises the whole method, not the
  paper's model.
* ``small`` — a Qwen3-0.6B-class model from a local Hugging Face folder (``--model-path DIR``),
  full prompts with reflections, reduced batch and lengths: one 24 GB GPU (``SMALL_HARDWARE``).
* ``small-lora`` — ``small`` with rank-16 LoRA adapters (frozen bfloat16 base), sized for one 16 GB
  Colab GPU (T4, ``LORA_HARDWARE``); see ``small_lora_overrides``.
* ``small-cpu`` — a 135M-0.6B model from a local folder on a laptop CPU (``small_cpu_overrides``):
  constrained actions, short reflections, rank-8 LoRA, 32 evaluation meta-episodes; minutes.
* ``paper`` — Qwen3-4B from a local folder with the paper's settings (docs/method.md §8), parameters
  and optimizer state sharded over all devices (``mesh.fsdp=-1``): a host of 8 H100 80 GB or a TPU
  v5p-8 (``PAPER_HARDWARE``).

``python -m experiments.plan --env ENV --preset PRESET`` checks a preset against its hardware ahead of
time (``Preset.hardware``; tests/experiments/test_plan.py holds every preset to it).

``EnvExperiment`` bundles what the experiment modules, ``experiments.baselines``, the ablations and
``experiments.table1`` need to know about one environment: its presets, its evaluation protocol
(``EvalProtocol``: extra held-out splits, references, which split is the paper's table entry) and the
titles of its splits. Every environment module defines one as ``SPEC``;
``experiments.environments.environment(name)`` looks them up, Kuhn Poker included.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from experiments.common import EXIT_INTERRUPTED, Preset, RunOptions, run_cli
from mage_jax import config as C
from mage_jax.evaluation.evaluator import EvalProtocol
from mage_jax.evaluation.report import results_table
from mage_jax.training.run import RunOutcome, evaluate, train


@dataclasses.dataclass(frozen=True)
class PaperSettings:
    """One column of the paper's settings table (docs/method.md §8)."""

    num_tasks: int
    group_size: int
    iterations: int
    max_turns: int
    max_prompt_tokens: int
    max_response_tokens: int
    kl: bool
    length_penalty: float
    invalid_penalty: float
    gamma_traj: float
    eval_num_episodes: int = 3
    """Episodes per evaluation meta-episode: the paper reports ALFWorld up to the 10th attempt and
    WebShop by the 5th (docs/method.md §2: evaluation may run more episodes than training)."""


PAPER_SETTINGS: dict[str, PaperSettings] = {
    "kuhn_poker": PaperSettings(16, 8, 150, 6, 4096, 8192, True, 2.0, 2.0, 0.6),
    "tic_tac_toe": PaperSettings(16, 8, 150, 8, 4096, 3072, True, 2.0, 0.5, 0.6),
    "alfworld": PaperSettings(8, 8, 150, 10, 4096, 1024, False, 0.0, 0.5, 0.6, eval_num_episodes=10),
    "sokoban": PaperSettings(16, 8, 300, 7, 4096, 4096, False, 1.0, 0.5, 0.9),
    "webshop": PaperSettings(8, 8, 150, 12, 8192, 1024, False, 0.0, 0.5, 0.6, eval_num_episodes=5),
    # MineSweeper is a LaMer task; the paper gives no column, so it follows Sokoban's single-agent recipe.
    "minesweeper": PaperSettings(16, 8, 300, 7, 4096, 4096, False, 1.0, 0.5, 0.6),
}

SMALL_HARDWARE = ("l4-24gb",)
"""Where the ``small`` presets must fit (names of ``experiments.plan.HARDWARE``): one 24 GB GPU."""
PAPER_HARDWARE = ("h100-80gb", "tpu-v5p")
"""Where the ``paper`` presets must fit: 8 x H100 80 GB, and a TPU v5p-8 (4 chips of 95 GiB)."""
LORA_HARDWARE = ("t4-16gb",)
"""Where the ``small-lora`` presets must fit: one 16 GB Colab GPU."""

TINY_MODEL = {
    "model.preset": "tiny",
    "model.overrides": {"hidden_size": 64, "intermediate_size": 192, "num_layers": 2, "num_heads": 4,
                        "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 2048},
    "tokenizer.kind": "word_level",
}


def tiny_overrides(*, max_prompt_tokens: int, max_response_tokens: int, invalid_penalty: float,
                   iterations: int = 60, eval_meta_episodes: int = 256, heldout_meta_episodes: int = 128,
                   num_tasks: int = 16, group_size: int = 8) -> dict[str, Any]:
    """From-scratch CPU scale: the same optimisation recipe as the Kuhn Poker tiny preset."""
    return {
        **TINY_MODEL,
        "rollout.num_tasks": num_tasks,
        "rollout.group_size": group_size,
        "rollout.num_episodes": 3,
        "rollout.memory_mode": "history_only",
        "rollout.reflect": False,
        "rollout.prompt_style": "compact",
        "rollout.constrained_actions": True,
        "rollout.max_prompt_tokens": max_prompt_tokens,
        "rollout.max_response_tokens": max_response_tokens,
        "rollout.privileged_reflection": False,
        "algorithm.invalid_penalty": invalid_penalty,
        "algorithm.length_penalty": 0.0,
        "optim.lr": 1e-3,
        "optim.weight_decay": 0.0,
        "optim.kl_coef": 0.0,
        "optim.entropy_coef": 0.001,
        "optim.mini_batch_rows": 64,
        "train.iterations": iterations,
        "train.eval_every": 20,
        "train.eval_meta_episodes": eval_meta_episodes,
        "train.eval_heldout_meta_episodes": heldout_meta_episodes,
        "checkpoint.every": 20,
        "checkpoint.keep": 2,
    }


def _pretrained(env: str, *, privileged_reflection: bool = False) -> dict[str, Any]:
    p = PAPER_SETTINGS[env]
    return {
        "tokenizer.kind": "hf",
        "tokenizer.enable_thinking": True,
        # Every decoder block recomputed in the backward pass: activations of one block at a time.
        "model.overrides": {"remat": "full"},
        "rollout.num_episodes": 3,
        "rollout.memory_mode": "reflection_only",
        "rollout.reflect": True,
        "rollout.prompt_style": "full",
        "rollout.constrained_actions": False,
        "rollout.privileged_reflection": privileged_reflection,
        "rollout.max_turns": p.max_turns,
        "algorithm.invalid_penalty": p.invalid_penalty,
        "algorithm.length_penalty": p.length_penalty,
        "algorithm.gamma_traj": p.gamma_traj,
        "optim.lr": 1e-6,
        "optim.kl_coef": 0.1 if p.kl else 0.0,
        "train.eval_every": 10,
        "train.eval_meta_episodes": 128,
        "train.eval_heldout_meta_episodes": 128,
        # No second copy of parameters and optimizer state during the updates (7.2 GB more would not fit
        # the small presets' 24 GB GPU by experiments.plan): a stop request there waits for the updates.
        "checkpoint.stop_during_updates": False,
    }


def small_overrides(env: str, **kwargs: Any) -> dict[str, Any]:
    """Qwen3-0.6B-class from a local folder: half the batch, shorter responses, 50 iterations, one GPU."""
    p = PAPER_SETTINGS[env]
    return {
        **_pretrained(env, **kwargs),
        "model.preset": "qwen3-0.6b",
        # One 24 GB GPU (python -m experiments.plan): bfloat16 activations and KV cache, one row per
        # forward/backward pass, 8 rows decoded at once (the float32 parameters, AdamW moments and
        # reference parameters alone hold 9.5 GB).
        "model.dtype": "bfloat16",
        "optim.micro_batch_rows": 1,
        "rollout.max_decode_rows": 8,
        "rollout.num_tasks": max(4, p.num_tasks // 2),
        "rollout.group_size": p.group_size,
        "rollout.max_prompt_tokens": min(p.max_prompt_tokens, 4096),
        "rollout.max_response_tokens": min(p.max_response_tokens, 1024),
        "train.iterations": 50,
    }


def small_lora_overrides(env: str, **kwargs: Any) -> dict[str, Any]:
    """The ``small`` recipe with LoRA, sized for one 16 GB Colab GPU (target hardware ``t4-16gb``).

    Rank-16 adapters (alpha 32) on every projection are all that is trained: the Qwen3-0.6B base is
    frozen in bfloat16 (the optimizer state covers the adapters only, ~10 M parameters) and the KL
    reference is the base with the adapters off, so no second copy exists. Activations are bfloat16;
    attention is blockwise because the T4 (sm75) has no cuDNN flash attention. The rollout is 4 tasks x
    4 meta-episodes with 2048-token prompts and 512-token responses (16 rows, and 16 meta-episodes per
    evaluation split: a 4.7 GB KV cache), the update runs 2-row micro-batches with every block
    rematerialised, log-probs are computed 128 tokens at a time (the [rows, chunk, vocab] logits
    block), and the learning rate is the usual LoRA one (1e-5, ten times the full fine-tuning rate).
    Its plan (``python -m experiments.plan --env kuhn_poker --preset small-lora``, XLA:CPU ahead of time,
    extrapolated to 28 layers, with ``small``'s 8 decoded rows) needs 8.4 GB per device at its largest
    program (the rollout), within the 14.4 GB the plan allows a 16 GB T4 and the 12 GB XLA takes by
    default (``XLA_PYTHON_CLIENT_MEM_FRACTION=.75``).
    """
    return {
        **small_overrides(env, **kwargs),
        "model.lora_rank": 16,
        "model.lora_alpha": 32.0,
        "model.dtype": "bfloat16",
        "model.overrides": {"remat": "full", "param_dtype": "bfloat16", "attention": "blockwise"},
        "rollout.num_tasks": 4,
        "rollout.group_size": 4,
        "rollout.max_prompt_tokens": 2048,
        "rollout.max_response_tokens": 512,
        "optim.lr": 1e-5,
        "optim.mini_batch_rows": 16,
        "optim.micro_batch_rows": 2,
        "optim.logprob_chunk": 128,
        "train.eval_meta_episodes": 16,
        "train.eval_heldout_meta_episodes": 16,
    }


CPU_HARDWARE = ()
"""The ``small-cpu`` presets name no accelerator: they are sized by time on a 2-core CPU (docs/results.md)."""


def small_cpu_overrides(env: str, **kwargs: Any) -> dict[str, Any]:
    """A 135M-0.6B pretrained model (``--model-path``) on a laptop CPU: zero-shot evaluation and LoRA
    training in minutes.

    What the time goes into on a CPU is prefilling prompts and compiling one program per prompt bucket
    and slot count, so: constrained actions (every play row is one legal ``<action>...</action>``, a few
    tokens, always valid; a small model rarely writes the tag unprompted), no thinking, short
    reflections (48 tokens), prompts up to 768 tokens in three buckets, 8 engine slots,
    float32 (XLA:CPU has no fast bfloat16 matmul). The update rematerialises every block and runs 2-row
    micro-batches (without remat, 4-row micro-batches of 792-token rows held 13 GB and were killed for
    memory on a 24 GB machine). Training is rank-8 LoRA (the base frozen, the KL reference is the base) on 2
    tasks x 2 meta-episodes per iteration; evaluation is 32 meta-episodes of the training pool at the
    end only (no held-out split: add ``--train.eval_heldout_meta_episodes N`` for it).
    """
    base = _pretrained(env, **kwargs)
    return {
        **base,
        "model.preset": "qwen3-0.6b",  # architecture, sizes and name come from the folder
        "model.dtype": "float32",
        "model.lora_rank": 8,
        "model.lora_alpha": 16.0,
        "tokenizer.enable_thinking": False,
        "rollout.constrained_actions": True,
        "rollout.num_tasks": 2,
        "rollout.group_size": 2,
        "rollout.max_prompt_tokens": 768,
        "rollout.length_buckets": [384, 512],
        "rollout.max_response_tokens": 24,
        "rollout.max_reflection_tokens": 48,
        "rollout.engine_slots": 8,
        "rollout.engine_chunk": 8,
        "optim.lr": 5e-5,
        "optim.mini_batch_rows": 16,
        "optim.micro_batch_rows": 2,
        "optim.logprob_chunk": 256,
        "train.iterations": 10,
        "train.eval_every": 0,
        "train.eval_meta_episodes": 32,
        "train.eval_heldout_meta_episodes": 0,
        "checkpoint.every": 5,
        "checkpoint.keep": 1,
    }


def paper_overrides(env: str, **kwargs: Any) -> dict[str, Any]:
    """Qwen3-4B with the paper's settings; activations in bfloat16, state sharded over all devices."""
    p = PAPER_SETTINGS[env]
    return {
        **_pretrained(env, **kwargs),
        "model.preset": "qwen3-4b",
        "model.dtype": "bfloat16",
        # Fits 8 x H100 80 GB and a TPU v5p-8 (4 chips of 95 GiB) by python -m experiments.plan (docs/
        # scaling.md): gradients accumulated over 8-row micro-batches (1 row per device on 8, 2 on 4), 64
        # engine slots decoded at once, each device prefilling and copying its own slots' prompts.
        "optim.micro_batch_rows": 8,
        "rollout.max_decode_rows": 64,
        "rollout.num_tasks": p.num_tasks,
        "rollout.group_size": p.group_size,
        "rollout.max_prompt_tokens": p.max_prompt_tokens,
        "rollout.max_response_tokens": p.max_response_tokens,
        "train.iterations": p.iterations,
        "train.eval_num_episodes": p.eval_num_episodes,
        "mesh.data": 1,
        "mesh.fsdp": -1,
    }


def scale_presets(env_overrides: Mapping[str, Any], tiny: Mapping[str, Any], env: str,
                  **pretrained_kwargs: Any) -> dict[str, Preset]:
    """The ``tiny`` / ``small`` / ``small-lora`` / ``small-cpu`` / ``paper`` presets of one environment."""
    return {
        "tiny": Preset({**env_overrides, **tiny},
                       "from-scratch 2-layer model, word-level tokenizer, CPU, minutes"),
        "small": Preset({**env_overrides, **small_overrides(env, **pretrained_kwargs)},
                        "Qwen3-0.6B-class model from --model-path, reflections, full prompts",
                        needs_model_path=True, hardware=SMALL_HARDWARE),
        "small-lora": Preset({**env_overrides, **small_lora_overrides(env, **pretrained_kwargs)},
                             "the small preset with LoRA adapters, for one 16 GB GPU (Colab T4)",
                             needs_model_path=True, hardware=LORA_HARDWARE),
        "small-cpu": Preset({**env_overrides, **small_cpu_overrides(env, **pretrained_kwargs)},
                            "a 135M-0.6B model from --model-path on a CPU: constrained actions, short "
                            "reflections, LoRA, minutes", needs_model_path=True, hardware=CPU_HARDWARE),
        "paper": Preset({**env_overrides, **paper_overrides(env, **pretrained_kwargs)},
                        "Qwen3-4B from --model-path, the paper's settings (docs/method.md §8)",
                        needs_model_path=True, hardware=PAPER_HARDWARE),
    }


SINGLE_AGENT = {"env.opponents": [], "env.opponent_ratios": [], "env.seats": "first",
                "env.heldout_opponent": None}


# ----------------------------------------------------------------------------------------------
# environment experiments


@dataclasses.dataclass(frozen=True)
class EnvExperiment:
    """Everything the experiment entry points need to know about one environment."""

    name: str
    presets: Mapping[str, Preset]
    protocol: Callable[[C.ExperimentConfig], EvalProtocol]
    """How a config of this environment is evaluated (extra splits, references, headline split)."""
    titles: Mapping[str, str] = dataclasses.field(default_factory=dict)
    description: str = ""
    default_preset: str = "tiny"

    def config(self, preset: str = "tiny", overrides: Mapping[str, Any] | None = None, *,
               check_paths: bool = True, experiment: str | None = None) -> C.ExperimentConfig:
        """The validated config of ``preset`` with dotted ``overrides`` (a missing model folder is a
        one-line ConfigError)."""
        if preset not in self.presets:
            known = ", ".join(self.presets)
            raise C.ConfigError(f"unknown preset {preset!r} for {self.name}; known: {known}")
        p = self.presets[preset]
        cfg = C.apply_overrides(C.ExperimentConfig(name=experiment or self.name), p.overrides)
        cfg = C.with_model_folder(C.apply_overrides(cfg, dict(overrides or {})))
        p.check(preset, cfg, check_paths=check_paths)
        return C.validate(cfg, check_paths=check_paths)

    def run(self, cfg: C.ExperimentConfig, *, resume: bool = False, trains: bool = True,
            protocol: EvalProtocol | None = None) -> RunOutcome:
        """Train (or, with ``trains=False``, only evaluate the initial model of) ``cfg``."""
        protocol = protocol or self.protocol(cfg)
        if not trains:
            return evaluate(cfg, protocol, experiment=cfg.name)
        return train(cfg, protocol, resume=resume, experiment=cfg.name)

    def main(self, argv: Sequence[str] | None = None) -> int:
        """``python -m experiments.<name>``: parse, train, print the results table."""

        def run(cfg: C.ExperimentConfig, options: RunOptions) -> int:
            outcome = self.run(cfg, resume=options.resume)
            if outcome.status != "finished":
                print(f"stopped at iteration {outcome.summary.get('iteration')}; checkpoint saved. Continue "
                      f"with: python -m experiments.{self.name} --run-dir {options.run_dir} --resume",
                      file=sys.stderr)
                return EXIT_INTERRUPTED
            print(results_table(outcome.summary, self.titles))
            return 0

        return run_cli(argv, run, experiment=self.name, presets=self.presets,
                       default_preset=self.default_preset, description=self.description)
