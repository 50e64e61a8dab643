"""What the meta-episode runner asks of a policy: text prompts in, sampled responses (with tokens) out.

The runner speaks text (environments and prompts are text); the policy owns tokens. ``LLMPolicy``
adapts the real tokenizer and the generation programs (``mage_jax.generate``); ``ScriptedPolicy``
answers from a Python function and is what the runner's tests (and baselines such as "random" or
"best fixed") use.

One interface: a policy opens a ``PolicyStream`` per rollout; requests go in one at a time and come
back as they finish. The stream also says how the runner schedules it (``lockstep``): a batch stream
(``BatchStream``, over a policy's batched ``generate``) answers everything submitted in one batched
call, and the runner admits one turn of every meta-episode at a time (docs/method.md §2, item 4); the
engine's stream (``LLMPolicy`` with a ``generate.engine.RolloutEngine``) takes requests whenever they
come (continuous batching).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from mage_jax import host_random
from mage_jax.generate.constraints import (
    TokenAutomaton,
    WordSequence,
    automaton_from_completions,
    automaton_from_word_sequence,
)
from mage_jax.generate.engine import EngineRequest, EngineSession, RolloutEngine
from mage_jax.generate.sampler import Sampler
from mage_jax.generate.spec import ModelSpec
from mage_jax.generate.step import SamplingParams
from mage_jax.tokenizer import PromptEncoder, Tokenizer


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One row to generate. ``allowed_completions``: when set, the response is constrained to be one of
    these strings (e.g. ``("<action>PASS</action>", "<action>BET</action>")``) followed by EOS, or to a
    ``WordSequence`` (a constrained reflection: 1..k words of a list between tags).
    ``max_new_tokens``: a per-row generation limit (play and reflect rows may differ); None: the
    policy's default."""

    prompt: str
    allowed_completions: tuple[str, ...] | WordSequence | None = None
    max_new_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class Generation:
    """One sampled response with everything the trainer needs to replay it.

    ``logprobs[i]`` is the sampler's log-probability of ``response_ids[i]``. ``truncated``: the response
    hit the token limit without an end-of-sequence token. ``skipped``: the prompt could not be fed to
    the model (too long or empty) and nothing was generated; the runner records an invalid row.
    ``constraint`` is the automaton that constrained the row (the sampler's ``TokenAutomaton`` for
    ``LLMPolicy``), or None when the row was free.
    """

    text: str
    prompt_ids: tuple[int, ...] | np.ndarray
    response_ids: tuple[int, ...] | np.ndarray
    logprobs: tuple[float, ...] | np.ndarray
    truncated: bool = False
    constraint: Any | None = None
    skipped: bool = False


@runtime_checkable
class PolicyStream(Protocol):
    """Requests in, (tag, generation) pairs out as they finish. ``key_path`` names the request
    (meta-episode, episode, phase/turn); the randomness of its response derives from it alone, not from
    the order or company it ran in (the engine; a batch stream draws per batch)."""

    lockstep: bool
    """The runner's scheduling rule: True: admit the earliest turn of every meta-episode waiting on it and
    wait for all of them before the next; False: submit each meta-episode's next request at once."""

    @property
    def busy(self) -> bool:
        """Some submitted request has not been collected yet."""
        ...

    def submit(self, tag: Any, request: GenerationRequest, key_path: tuple[int, ...],
               priority: tuple[int, ...] = ()) -> None:
        """Queue ``request``; waiting requests start smallest ``priority`` first, then in arrival order."""
        ...

    def collect(self) -> list[tuple[Any, Generation]]:
        """Advance generation a little; the (tag, generation) pairs that finished meanwhile."""
        ...


@runtime_checkable
class Policy(Protocol):
    """A text policy: one stream per rollout."""

    def stream(self) -> PolicyStream:
        """A fresh stream of requests and results (the policy's state at this moment)."""
        ...

    def prompt_lengths(self, prompts: Sequence[str]) -> list[int]:
        """Token count of each prompt as it would be fed to the model (chat template included)."""
        ...


class BatchStream:
    """A lockstep stream over a batched ``generate(requests) -> generations``: ``collect`` answers
    every request submitted since the last one in one call, in submission order."""

    lockstep = True

    def __init__(self, generate: Callable[[Sequence[GenerationRequest]], list[Generation]]):
        self._generate = generate
        self._submitted: list[tuple[Any, GenerationRequest]] = []

    @property
    def busy(self) -> bool:
        return bool(self._submitted)

    def submit(self, tag: Any, request: GenerationRequest, key_path: tuple[int, ...],
               priority: tuple[int, ...] = ()) -> None:
        self._submitted.append((tag, request))

    def collect(self) -> list[tuple[Any, Generation]]:
        batch, self._submitted = self._submitted, []
        if not batch:
            return []
        generations = self._generate([r for _, r in batch])
        if len(generations) != len(batch):
            raise RuntimeError(f"the policy returned {len(generations)} generations for {len(batch)} "
                               "requests")
        return [(tag, g) for (tag, _), g in zip(batch, generations)]


def _byte_ids(text: str) -> tuple[int, ...]:
    return tuple(text.encode("utf-8"))


class RandomLegalPolicy:
    """Uniform over each request's allowed completions (its legal actions). A request without them gets a
    fixed answer: ``reflection`` for a reflect prompt, ``otherwise`` for any other. The random reference of
    an evaluation and the word-level tokenizer's corpus both play with it."""

    def __init__(self, seed: int, *, reflection: str = "<remark></remark>",
                 otherwise: str = "<remark></remark>"):
        self._rng = np.random.default_rng(seed)
        self.reflection, self.otherwise = reflection, otherwise

    def prompt_lengths(self, prompts: Sequence[str]) -> list[int]:
        return [len(p.split()) for p in prompts]

    def stream(self) -> PolicyStream:
        return BatchStream(self.generate)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        out = []
        for req in requests:
            allowed = req.allowed_completions
            if isinstance(allowed, WordSequence):
                text = allowed.sample(self._rng)
            elif allowed:
                text = allowed[int(self._rng.integers(len(allowed)))]
            else:
                text = self.reflection if "<remark>" in req.prompt else self.otherwise
            out.append(Generation(text=text, prompt_ids=(0,), response_ids=(0,), logprobs=(0.0,)))
        return out


class ScriptedPolicy:
    """A policy from a Python function ``fn(prompt) -> response text``.

    Token ids are the UTF-8 bytes of the text, or come from ``tokenizer`` when given (prompts with
    its chat template, responses followed by its first EOS id, as a sampled response would be);
    log-probs are zero. Every ``generate`` call is kept in ``calls`` (the requests of that call), so
    tests can check lockstep batching. A constrained request whose scripted answer is not one of the allowed
    completions gets the first allowed completion, as constrained decoding would force a legal one.
    """

    def __init__(
        self, fn: Callable[[str], str], *, tokenizer: Any | None = None, enforce_constraints: bool = True
    ):
        self.fn = fn
        self.tokenizer = tokenizer
        self.enforce_constraints = enforce_constraints
        self.calls: list[list[GenerationRequest]] = []

    def _encode_prompt(self, prompt: str) -> tuple[int, ...]:
        if self.tokenizer is None:
            return _byte_ids(prompt)
        return tuple(self.tokenizer.encode_prompts([prompt])[0])

    def _encode_response(self, text: str) -> tuple[int, ...]:
        if self.tokenizer is None:
            return _byte_ids(text)
        eos = tuple(getattr(self.tokenizer, "eos_ids", ()) or ())[:1]
        return tuple(self.tokenizer.encode(text)) + eos

    def prompt_lengths(self, prompts: Sequence[str]) -> list[int]:
        return [len(self._encode_prompt(p)) for p in prompts]

    def stream(self) -> PolicyStream:
        return BatchStream(self.generate)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        self.calls.append(list(requests))
        out = []
        for req in requests:
            text = self.fn(req.prompt)
            if not isinstance(text, str):
                text = ""
            allowed = req.allowed_completions
            if self.enforce_constraints and isinstance(allowed, WordSequence):
                text = text if allowed.accepts(text) else allowed.first()
            elif self.enforce_constraints and allowed and text not in allowed:
                text = allowed[0]
            response_ids = self._encode_response(text)
            out.append(
                Generation(
                    text=text,
                    prompt_ids=self._encode_prompt(req.prompt),
                    response_ids=response_ids,
                    logprobs=tuple(0.0 for _ in response_ids),
                    truncated=False,
                    constraint=None,
                )
            )
        return out


class LLMPolicy:
    """The real policy: tokenizer + a generator + the current parameter state.

    ``generator`` is the run's ``generate.engine.RolloutEngine`` (its stream is the engine's: continuous
    batching) or its lockstep ``generate.sampler.Sampler`` (a ``BatchStream`` over ``generate``, one call
    per turn); both carry the model's ``ModelSpec`` (vocabulary, end-of-sequence ids, prompt buckets).
    ``params_state`` is the model state it reads (a policy is built per rollout, with the parameters of
    that moment). ``rng`` is a JAX PRNG key split once per ``generate`` call or stream. Prompts longer than
    ``max_prompt_tokens`` (or the largest prompt bucket) are not sent to the model: they come back as an
    empty, truncated response (an invalid turn), never an error; the runner normally shortens prompts
    before that happens. Automata for constrained rows are built once per distinct set of allowed
    completions and cached (with an engine, across rollouts).
    """

    def __init__(self, tokenizer: Tokenizer, generator: Sampler | RolloutEngine, params_state: Any,
                 sampling_params: SamplingParams, rng: jax.Array, max_prompt_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.spec: ModelSpec = generator.spec
        self.engine = generator if isinstance(generator, RolloutEngine) else None
        self.sampler = generator if isinstance(generator, Sampler) else None
        self.params_state = params_state
        self.sampling_params = sampling_params
        self.rng = rng
        self.max_prompt_tokens = max_prompt_tokens
        self._automata: dict[tuple[str, ...] | WordSequence, TokenAutomaton] = {}
        self._prompt_cache: dict[str, list[int]] = {}
        self._prompt_encoder = PromptEncoder(tokenizer)  # tokenizes what a prompt adds to earlier ones

    # -- tokens --------------------------------------------------------------------------------
    def _encode(self, prompts: Sequence[str]) -> list[list[int]]:
        missing = [p for p in dict.fromkeys(prompts) if p not in self._prompt_cache]
        if missing:
            for p, ids in zip(missing, self._prompt_encoder.encode_prompts(missing)):
                self._prompt_cache[p] = list(ids)
        return [self._prompt_cache[p] for p in prompts]

    def prompt_lengths(self, prompts: Sequence[str]) -> list[int]:
        return [len(ids) for ids in self._encode(prompts)]

    def automaton(self, completions: tuple[str, ...] | WordSequence) -> TokenAutomaton:
        """The automaton that accepts exactly ``completions`` (each followed by EOS).

        Completions are tokenized as raw response text (no template, no special tokens); every word of
        a ``WordSequence`` must be one token (the config and the tokenizer build check it).
        """
        if completions in self._automata:
            return self._automata[completions]
        shared = self.engine.automata if self.engine is not None else None  # kept across rollouts
        vocab, eos = self.spec.vocab_size, self.spec.eos_ids
        key = (id(self.tokenizer), vocab, completions)
        found = shared.get(key) if shared is not None else None
        if found is not None:
            self._automata[completions] = found
        else:
            if isinstance(completions, WordSequence):
                word_ids = []
                for word in completions.words:
                    ids = self.tokenizer.encode(word)
                    if len(ids) != 1:
                        raise ValueError(f"reflection word {word!r} is {len(ids)} tokens, not one")
                    word_ids.append(ids[0])
                automaton = automaton_from_word_sequence(
                    self.tokenizer.encode(completions.open_tag), word_ids,
                    self.tokenizer.encode(completions.close_tag), completions.max_words, vocab, eos)
            else:
                sequences = [self.tokenizer.encode(c) for c in completions]
                automaton = automaton_from_completions(sequences, vocab, eos)
            self._automata[completions] = automaton
            if shared is not None:
                shared.put(key, automaton)
        return self._automata[completions]

    def _prompt_limit(self) -> int:
        """The longest prompt the model may get: ``max_prompt_tokens`` and the largest prompt bucket."""
        largest = self.spec.prompt_buckets[-1]
        return largest if self.max_prompt_tokens is None else min(self.max_prompt_tokens, largest)

    # -- generation ----------------------------------------------------------------------------
    def stream(self) -> PolicyStream:
        """The engine's continuous-batching stream, or without an engine a lockstep ``BatchStream``."""
        if self.engine is None:
            return BatchStream(self.generate)
        self.rng, key = host_random.split(self.rng)
        return EngineStream(self, self.engine.session(self.params_state, self.sampling_params, key))

    def prepare_all(self, requests: Sequence[GenerationRequest]) -> list[Prepared | None]:
        """What each request asks of the model: its prompt ids (every prompt tokenized in one tokenizer
        call), token limit and automaton; None where the prompt cannot be fed to the model (empty, or
        over the prompt limit: the request is answered as skipped)."""
        every_ids = self._encode([r.prompt for r in requests])
        for r in requests:
            self._prompt_cache.pop(r.prompt, None)
        limit = self._prompt_limit()
        out: list[Prepared | None] = []
        for request, ids in zip(requests, every_ids):
            if not ids or len(ids) > limit:
                out.append(None)
                continue
            allowed = request.allowed_completions
            automaton = self.automaton(allowed) if allowed else None
            limit_tokens = int(request.max_new_tokens or self.sampling_params.max_new_tokens)
            out.append(Prepared(np.asarray(ids, dtype=np.int32), limit_tokens, automaton))
        return out

    def decode(self, responses: Sequence[np.ndarray]) -> list[str]:
        """The text of each response (token ids)."""
        return self.tokenizer.decode_batch([list(map(int, t)) for t in responses])

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Every request in one batched call of the lockstep sampler (the ``BatchStream`` of a policy
        without an engine), in request order."""
        if self.sampler is None:
            raise TypeError("generate runs the lockstep sampler; a policy over the engine streams (stream())")
        prepared = self.prepare_all(requests)
        fits = [(i, p) for i, p in enumerate(prepared) if p is not None]
        # A prompt that cannot be fed to the model gets an empty response (an invalid turn), not an error.
        results: list[Generation] = [_SKIPPED] * len(requests)
        if fits:
            rows = [p for _, p in fits]
            self.rng, key = host_random.split(self.rng)
            out = self.sampler.generate(
                self.params_state, [p.prompt_ids for p in rows], self.sampling_params, key,
                constraints=[p.automaton for p in rows],
                max_new_tokens_per_row=np.asarray([p.limit for p in rows], dtype=np.int32),
            )
            for (i, p), tokens, logprobs, finished, text in zip(fits, out.tokens, out.logprobs, out.finished,
                                                                 self.decode(out.tokens)):
                results[i] = Generation(
                    text=text, prompt_ids=p.prompt_ids, response_ids=np.asarray(tokens, dtype=np.int32),
                    logprobs=np.asarray(logprobs, dtype=np.float32), truncated=not bool(finished),
                    constraint=p.automaton)
        return results


_SKIPPED = Generation(text="", prompt_ids=(), response_ids=(), logprobs=(), truncated=True, skipped=True)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A request in tokens: its prompt ids, response token limit and automaton (None: free)."""

    prompt_ids: np.ndarray
    limit: int
    automaton: TokenAutomaton | None


class EngineStream:
    """``LLMPolicy`` over one engine session: text in, ``Generation`` out (prompts that cannot be fed
    to the model come back at once as skipped, like ``generate``). Requests submitted between two
    ``collect`` calls are tokenized together (one tokenizer call) and enter the session in order."""

    lockstep = False

    def __init__(self, policy: LLMPolicy, session: EngineSession):
        self.policy = policy
        self.session = session
        self._ready: list[tuple[Any, Generation]] = []
        self._prepared: dict[Any, Prepared] = {}
        self._pending: list[tuple[Any, GenerationRequest, tuple[int, ...], tuple[int, ...]]] = []

    @property
    def busy(self) -> bool:
        return bool(self._ready or self._pending) or self.session.busy

    def submit(self, tag: Any, request: GenerationRequest, key_path: tuple[int, ...],
               priority: tuple[int, ...] = ()) -> None:
        for k in key_path:  # checked now, so a bad key path is an error of this call
            if not 0 <= int(k) < 2**31:
                raise ValueError(f"key_path must be integers in [0, 2**31), got {tuple(key_path)}")
        self._pending.append((tag, request, tuple(int(k) for k in key_path), tuple(priority)))

    def _flush(self) -> None:
        """Tokenize the requests submitted since the last ``collect`` at once and hand them on."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        for (tag, _, key_path, priority), prepared in zip(
                pending, self.policy.prepare_all([request for _, request, _, _ in pending])):
            if prepared is None:
                self._ready.append((tag, _SKIPPED))
                continue
            self._prepared[tag] = prepared
            self.session.submit(EngineRequest(
                tag=tag, prompt_ids=tuple(prepared.prompt_ids.tolist()), limit=prepared.limit,
                automaton=prepared.automaton, key_path=key_path, priority=priority,
            ))

    def collect(self) -> list[tuple[Any, Generation]]:
        self._flush()
        out, self._ready = self._ready, []
        if not self.session.busy:
            return out
        results = self.session.step()
        for r, text in zip(results, self.policy.decode([r.tokens for r in results])):
            prepared = self._prepared.pop(r.tag)
            out.append((r.tag, Generation(
                text=text, prompt_ids=prepared.prompt_ids, response_ids=np.asarray(r.tokens, dtype=np.int32),
                logprobs=np.asarray(r.logprobs, dtype=np.float32), truncated=not r.finished,
                constraint=prepared.automaton,
            )))
        return out
