"""Policies: the scripted one for tests and baselines, and the adapter over the real tokenizer + sampler."""

import itertools

import jax
import numpy as np
import pytest
from flax import nnx

from mage_jax.generate.constraints import TokenAutomaton, WordSequence
from mage_jax.generate.sampler import Sampler
from mage_jax.generate.slots import compiled_engine
from mage_jax.generate.spec import ModelSpec
from mage_jax.generate.step import SamplingParams
from mage_jax.models import sharding as shd
from mage_jax.models.config import ModelConfig
from mage_jax.models.transformer import Transformer
from mage_jax.rollout.meta_episode import MetaEpisodeRunner
from mage_jax.rollout.policy import GenerationRequest, LLMPolicy, Policy, RandomLegalPolicy, ScriptedPolicy
from mage_jax.rollout.rows import pack_rows
from mage_jax.rollout.tasks import TaskSampler, TaskSamplerConfig
from mage_jax.testing import SMALLEST_DECODER, runner_config
from mage_jax.tokenizer import Tokenizer
from mage_jax.training.train_step import StepConfig, TrainBatch, TrainStep

ACTIONS = ("<action>PASS</action>", "<action>BET</action>")
WORDS = ("bets", "King", "weak")


def test_scripted_policy_answers_in_order_records_calls_and_obeys_constraints():
    policy = ScriptedPolicy(lambda p: p.upper())
    assert isinstance(policy, Policy)
    out = policy.generate([GenerationRequest("ab"), GenerationRequest("c", ACTIONS)])
    assert [g.text for g in out] == ["AB", ACTIONS[0]]  # "C" is not allowed: the first completion is forced
    assert list(out[0].response_ids) == list(b"AB") and list(out[0].logprobs) == [0.0, 0.0]
    assert policy.prompt_lengths(["abc", ""]) == [3, 0]
    assert [[r.prompt for r in call] for call in policy.calls] == [["ab", "c"]]


def test_scripted_and_random_policies_obey_a_word_sequence():
    words = WordSequence(WORDS, max_words=2)
    scripted = ScriptedPolicy(lambda p: "<remark>King weak</remark>" if p == "ok" else "<remark>why</remark>")
    out = scripted.generate([GenerationRequest("ok", words), GenerationRequest("no", words)])
    assert [g.text for g in out] == ["<remark>King weak</remark>", "<remark>bets</remark>"]
    texts = [g.text for g in RandomLegalPolicy(0).generate([GenerationRequest("x", words)] * 50)]
    assert all(words.accepts(t) for t in texts) and len(set(texts)) > 5


@pytest.fixture(scope="module")
def kuhn_llm():
    """A word-level tokenizer built from compact Kuhn prompts and a tiny random decoder."""
    tasks = TaskSampler(
        TaskSamplerConfig(num_tasks=4, group_size=2, opponents={"aggressive": 1.0}, seats="mixed")
    ).sample_train(0)
    cfg = runner_config(num_episodes=2, prompt_style="compact", constrained_actions=True, keep_text=True)
    scripted = ScriptedPolicy(lambda p: "<remark>bet with king</remark>" if "remark" in p else ACTIONS[1])
    corpus = [
        r.prompt_text
        for r in MetaEpisodeRunner("kuhn_poker", {}, cfg).run(tasks, scripted, training=True).rows
    ]
    tokenizer = Tokenizer.word_level(corpus + list(ACTIONS) + ["<remark> " + " ".join(WORDS) + " </remark>"])
    config = ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size, **SMALLEST_DECODER)
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    spec = ModelSpec(graphdef, config, eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id,
                     prompt_buckets=(256,))
    sampler = Sampler(spec, batch_buckets=(8,))
    return tasks, tokenizer, sampler, state


def test_llm_policy_plays_constrained_kuhn_meta_episodes_end_to_end(kuhn_llm):
    tasks, tokenizer, sampler, state = kuhn_llm
    policy = LLMPolicy(tokenizer, sampler, state, SamplingParams(max_new_tokens=6), jax.random.key(0), 256)
    cfg = runner_config(
        num_episodes=2,
        prompt_style="compact",
        constrained_actions=True,
        max_prompt_tokens=256,
        max_reflection_tokens=4,
        keep_text=True,
    )
    result = MetaEpisodeRunner("kuhn_poker", {}, cfg).run(tasks, policy, training=True)
    play = [r for r in result.rows if r.phase == "play"]
    reflect = [r for r in result.rows if r.phase == "reflect"]
    assert play and all(r.valid and r.response_text in ACTIONS for r in play)  # constrained decoding
    assert all(isinstance(r.constraint, TokenAutomaton) for r in play)
    assert all(r.constraint is None and r.response_length <= 4 for r in reflect)
    for r in result.rows:
        assert len(r.logprobs) == r.response_length and np.all(r.logprobs <= 0)
        assert r.prompt_ids[0] == tokenizer.bos_id
    assert len({id(r.constraint) for r in play}) == 1  # one automaton per distinct legal set
    batch = pack_rows(result.rows, row_bucket=8, length_buckets=(128, 256), pad_id=tokenizer.pad_id)
    transitions = batch.row_transitions()
    assert transitions.shape[0] == batch.shape[0] and transitions.shape[2] == sampler.spec.vocab_size


def test_llm_policy_skips_prompts_it_cannot_feed_to_the_model(kuhn_llm):
    _, tokenizer, sampler, state = kuhn_llm
    policy = LLMPolicy(tokenizer, sampler, state, SamplingParams(max_new_tokens=6), jax.random.key(1), 5)
    out = policy.generate([GenerationRequest("PASS " * 50), GenerationRequest("BET", max_new_tokens=2)])
    assert out[0].skipped and out[0].text == "" and len(out[0].response_ids) == 0
    assert not out[1].skipped and 1 <= len(out[1].response_ids) <= 2


def test_constrained_reflections_are_sampled_under_the_automaton_the_train_step_replays(kuhn_llm):
    """Reflect rows decoded under ``<remark>`` + 1..2 words + ``</remark>``: every reflection is such a text,
    and the train step's recomputed log-probs (automata replayed from the packed rows) are the sampler's."""
    tasks, tokenizer, sampler, state = kuhn_llm
    policy = LLMPolicy(tokenizer, sampler, state, SamplingParams(max_new_tokens=6), jax.random.key(3), 256)
    cfg = runner_config(num_episodes=3, prompt_style="compact", constrained_actions=True,
                       max_prompt_tokens=256, reflection_words=WORDS, reflection_max_words=2, keep_text=True)
    result = MetaEpisodeRunner("kuhn_poker", {}, cfg).run(tasks, policy, training=True)
    reflect = [r for r in result.rows if r.phase == "reflect"]
    assert reflect and all(isinstance(r.constraint, TokenAutomaton) for r in reflect)
    words = WordSequence(WORDS, max_words=2)
    assert all(r.valid and words.accepts(r.response_text) for r in reflect)
    assert {t for o in result.outcomes for t in o.reflections} <= {
        " ".join(w) for m in (1, 2) for w in itertools.product(WORDS, repeat=m)}
    packed = pack_rows(result.rows, row_bucket=8, length_buckets=(256,), pad_id=tokenizer.pad_id)
    step = TrainStep(sampler.spec.graphdef, None, None, StepConfig(constraint_len=6, chunk_size=64),
                     shd.make_mesh(shd.MeshConfig(data=1, fsdp=1, tensor=1)))
    batch = TrainBatch.from_packed(packed, np.arange(packed.tokens.shape[0]), constrained=True)
    got = np.asarray(step.compute_logprobs(state, step.place_batch(batch)))
    rows = len(result.rows)
    is_reflect = np.asarray([r.phase == "reflect" for r in result.rows] + [False] * (len(got) - rows))
    mask = batch.response_mask & is_reflect[:, None]
    assert mask.sum() >= 3 * len(reflect)  # <remark>, a word, </remark>, EOS of every reflection
    np.testing.assert_allclose(got[mask], packed.sampling_logprobs[mask], atol=2e-5)
    free = np.asarray(step.compute_logprobs(state, step.place_batch(batch.replace(transitions=None))))
    assert (free[mask] < got[mask] - 1e-6).any()  # the replayed automaton is what makes them agree


class CountingTokenizer:
    """The tokenizer, counting its prompt-encoding calls: ``encode_prompts``, and the word-level backend's
    batch calls (``PromptEncoder`` sends it the text each prompt adds to earlier ones; all of it for the
    first prompts)."""

    def __init__(self, tokenizer):
        self.inner, self.prompt_calls = tokenizer, []
        self.backend = CountingBackend(tokenizer.backend, self.prompt_calls)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode_prompts(self, texts):
        self.prompt_calls.append(list(texts))
        return self.inner.encode_prompts(texts)


class CountingBackend:
    def __init__(self, backend, calls):
        self.inner, self.calls = backend, calls

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode_batch(self, texts, **kwargs):
        self.calls.append(list(texts))
        return self.inner.encode_batch(texts, **kwargs)


def test_the_engine_stream_tokenizes_the_prompts_submitted_together_in_one_call(kuhn_llm):

    _, tokenizer, sampler, state = kuhn_llm
    counting = CountingTokenizer(tokenizer)
    engine = compiled_engine(sampler.spec, slots=2, max_new_tokens=3, chunk=3)
    policy = LLMPolicy(counting, engine, state, SamplingParams(max_new_tokens=3), jax.random.key(0), 6)
    stream = policy.stream()
    requests = [GenerationRequest("BET"), GenerationRequest("PASS " * 50), GenerationRequest("PASS BET"),
                GenerationRequest("BET", ACTIONS)]
    for i, request in enumerate(requests):
        stream.submit(i, request, (i, 0, 0))
    assert counting.prompt_calls == []  # nothing tokenized before the engine is asked for results
    out = {}
    while stream.busy:
        out.update(stream.collect())
    assert counting.prompt_calls == [["BET", "PASS " * 50, "PASS BET"]]  # one call, each prompt once
    assert out[1].skipped and not any(out[i].skipped for i in (0, 2, 3))
    assert out[3].text in ACTIONS and 1 <= len(out[0].response_ids) <= 3


def test_policies_over_one_engine_share_their_automata_so_the_bank_factorises_each_once(kuhn_llm):
    _, tokenizer, sampler, state = kuhn_llm
    engine = compiled_engine(sampler.spec, slots=2, max_new_tokens=3, chunk=3)
    first, second = (LLMPolicy(tokenizer, engine, state, SamplingParams(max_new_tokens=3), jax.random.key(k))
                     for k in range(2))
    automaton = first.automaton(ACTIONS)
    assert second.automaton(ACTIONS) is automaton  # a policy per rollout, the automaton built once per run
    assert engine.bank.index(automaton) == engine.bank.index(second.automaton(ACTIONS)) == 1
    alone = LLMPolicy(tokenizer, sampler, state, SamplingParams(max_new_tokens=3), jax.random.key(0))
    other = alone.automaton(ACTIONS)  # no engine: the policy's own cache, same transitions
    assert other is not automaton and (other.transitions == automaton.transitions).all()
