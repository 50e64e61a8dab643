"""Specification of mage_jax.tokenizer: HF chat templates (one user message, thinking switch) and the
built-in word-level tokenizer (tags as single tokens, action strings round-trip)."""

from __future__ import annotations

import json
import shutil

import pytest

from mage_jax.envs.parsing import extract_action
from mage_jax.rollout.meta_episode import MetaEpisodeRunner
from mage_jax.rollout.policy import RandomLegalPolicy
from mage_jax.rollout.tasks import TaskSampler, TaskSamplerConfig
from mage_jax.testing import build_bpe_tokenizer, runner_config, write_tiny_alfworld_data
from mage_jax.tokenizer import PromptEncoder, Tokenizer, TokenizerError, join_word_pieces
from tests.optional import require

CORPUS = [
    "You are playing Kuhn Poker. Your card is K. Legal actions: PASS, BET.",
    "Think step by step, then answer inside <action>...</action>. <action>PASS</action> <action>BET</action>",
    "Board: X at (0, 0), O at (1, 1). Place a mark: <action>(1, 2)</action>",
    "<remark>I should bet with a king.</remark> search[red shoes] click[buy now]",
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tok")
    build_bpe_tokenizer(path, CORPUS * 4, vocab_size=400)
    return path


# ------------------------------------------------------------------------------------------ HF path
def test_hf_prompt_is_one_user_message_with_generation_prompt_and_thinking_on(hf_dir):
    tok = Tokenizer.from_hf_dir(hf_dir, enable_thinking=True)
    text = "Your card is K."
    assert tok.render_prompt(text) == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    [ids] = tok.encode_prompts([text])
    assert tok.decode(ids, skip_special_tokens=False) == tok.render_prompt(text)
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert "system" not in tok.decode(ids, skip_special_tokens=False)


def test_hf_thinking_off_appends_an_empty_think_block(hf_dir):
    tok = Tokenizer.from_hf_dir(hf_dir, enable_thinking=False)
    assert tok.render_prompt("hi").endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    [ids] = tok.encode_prompts(["hi"])
    assert tok.token_to_id("<think>") in ids and tok.token_to_id("</think>") in ids


CHATML_WITHOUT_SWITCH = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_thinking_asked_of_a_template_without_thinking_switch_warns_once(hf_dir, tmp_path, capsys):
    plain = tmp_path / "plain"
    shutil.copytree(hf_dir, plain)
    (plain / "chat_template.jinja").write_text(CHATML_WITHOUT_SWITCH)
    capsys.readouterr()
    Tokenizer.from_hf_dir(hf_dir, enable_thinking=True)  # Qwen3-style: the switch applies, no warning
    assert capsys.readouterr().err == ""
    tok = Tokenizer.from_hf_dir(plain, enable_thinking=False)  # thinking off: such a template never thinks
    assert tok.render_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert capsys.readouterr().err == ""
    for _ in range(2):
        Tokenizer.from_hf_dir(plain, enable_thinking=True)
    assert capsys.readouterr().err == (
        f"warning: the chat template of {str(plain)!r} has no thinking switch: "
        "tokenizer.enable_thinking=true has no effect on its prompts (set it to false to silence this)\n")


def test_hf_stop_ids_cover_eos_im_end_and_generation_config(hf_dir):
    tok = Tokenizer.from_hf_dir(hf_dir)
    assert set(tok.eos_ids) == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    assert tok.eos_ids[0] == tok.token_to_id("<|im_end|>")
    assert tok.pad_id == tok.token_to_id("<|endoftext|>")
    assert tok.vocab_size == len(tok.backend)


def test_hf_batch_encode_matches_single_encodes_and_decode_drops_special_tokens(hf_dir):
    tok = Tokenizer.from_hf_dir(hf_dir)
    texts = ["Your card is K.", "Board: X at (0, 0)."]
    assert tok.encode_prompts(texts) == [tok.encode_prompts([t])[0] for t in texts]
    response = tok.encode("<think>bet</think> <action>BET</action>") + [tok.eos_ids[0]]
    decoded = tok.decode(response)
    assert decoded == "<think>bet</think> <action>BET</action>"
    assert extract_action(decoded) == "BET"
    assert tok.decode_batch([response, response]) == [decoded, decoded]


def test_hf_save_load_keeps_thinking_switch_and_stop_ids(hf_dir, tmp_path):
    tok = Tokenizer.from_hf_dir(hf_dir, enable_thinking=False)
    tok.save(tmp_path / "saved")
    again = Tokenizer.load(tmp_path / "saved")
    assert again.kind == "hf" and again.enable_thinking is False
    assert again.eos_ids == tok.eos_ids
    assert again.encode_prompts(["a b"]) == tok.encode_prompts(["a b"])


def test_hf_missing_folder_or_template_is_one_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_hf_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="cannot load"):
        Tokenizer.from_hf_dir(tmp_path / "empty")



@pytest.mark.parametrize("file, auto_map", [
    ("tokenizer_config.json", {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}),
    ("config.json", {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None],
                     "AutoModelForCausalLM": "modeling_custom.CustomModel"}),
])
def test_hf_tokenizer_that_needs_remote_code_is_refused_with_one_line(hf_dir, tmp_path, file, auto_map):
    folder = tmp_path / "remote"
    shutil.copytree(hf_dir, folder)
    path = folder / file
    settings = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**settings, "auto_map": auto_map}))
    with pytest.raises(TokenizerError, match=f"needs remote code \\({file} has an auto_map entry\\)") as info:
        Tokenizer.from_hf_dir(folder)
    assert "\n" not in str(info.value)


def test_a_model_auto_map_without_a_tokenizer_entry_does_not_block_the_tokenizer(hf_dir, tmp_path):
    folder = tmp_path / "model_only"
    shutil.copytree(hf_dir, folder)
    (folder / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "modeling_x.X"}}))
    assert Tokenizer.from_hf_dir(folder).kind == "hf"

# ---------------------------------------------------------------------------------------- word level
@pytest.fixture(scope="module")
def word_tok():
    return Tokenizer.word_level(CORPUS)


def test_word_level_tags_are_single_tokens(word_tok):
    ids = word_tok.encode("<action>PASS</action>")
    assert [word_tok.backend.id_to_token(i) for i in ids] == ["<action>", "PASS", "</action>"]


def test_word_level_specials_and_prompt_template_is_bos_plus_words(word_tok):
    assert [word_tok.token_to_id(t) for t in ("[PAD]", "[UNK]", "[BOS]", "[EOS]")] == [0, 1, 2, 3]
    assert word_tok.pad_id == 0 and word_tok.eos_ids == (3,) and word_tok.bos_id == 2
    [ids] = word_tok.encode_prompts(["Your card is K."])
    assert ids == [2, *word_tok.encode("Your card is K.")]
    assert word_tok.decode(ids) == "Your card is K."


@pytest.mark.parametrize(
    "action",
    [
        "<action>PASS</action>",
        "<action>(1, 2)</action>",
        "(1, 2)",
        "<remark>I should bet with a king.</remark>",
        "search[red shoes]",
    ],
)
def test_word_level_action_strings_round_trip(word_tok, action):
    ids = word_tok.encode(action)
    assert word_tok.token_to_id("[UNK]") not in ids
    assert word_tok.decode(ids + list(word_tok.eos_ids)) == action


def test_word_level_decoded_response_parses_to_the_action(word_tok):
    response = word_tok.encode("Think step by step, then <action>(1, 2)</action>") + [3, 0, 0]
    assert extract_action(word_tok.decode(response)) == "(1, 2)"


def test_word_level_unknown_words_map_to_unk(word_tok):
    assert word_tok.encode("zebra") == [word_tok.token_to_id("[UNK]")]


def test_single_token_id_is_none_for_unknown_or_split_words(word_tok):
    assert word_tok.single_token_id("PASS") == word_tok.encode("PASS")[0]
    assert word_tok.single_token_id("zebra") is None  # [UNK]
    assert word_tok.single_token_id("PASS PASS") is None and word_tok.single_token_id("") is None


def test_word_level_vocab_size_caps_the_vocabulary():
    tok = Tokenizer.word_level(CORPUS, vocab_size=10)
    assert tok.vocab_size == 10


def test_word_level_save_load_round_trip(word_tok, tmp_path):
    word_tok.save(tmp_path / "wl")
    assert (tmp_path / "wl" / "tokenizer.json").exists() and (
        tmp_path / "wl" / "mage_tokenizer.json"
    ).exists()
    again = Tokenizer.load(tmp_path / "wl")
    assert again.kind == "word_level" and again.vocab_size == word_tok.vocab_size
    for text in CORPUS:
        assert again.encode_prompts([text]) == word_tok.encode_prompts([text])


def test_word_level_empty_corpus_is_one_clear_error():
    with pytest.raises(TokenizerError, match="empty"):
        Tokenizer.word_level([])


def test_malformed_meta_file_is_one_clear_error(tmp_path):
    (tmp_path / "mage_tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="malformed"):
        Tokenizer.load(tmp_path)


def test_join_word_pieces_spacing_rules():
    assert (
        join_word_pieces(["Pot", ":", "2", "chips", ".", "Your", "card", "is", "K", "."])
        == "Pot: 2 chips. Your card is K."
    )
    assert join_word_pieces(["line", "\n", "next"]) == "line\nnext"
    assert join_word_pieces(["trial", "#", "2"]) == "trial #2"


# ------------------------------------------------------------------------- files for transformers
EXPORT_TEXTS = [
    *CORPUS,
    "Board:\nX . O\n. X .\nYour move: <action>(2, 2)</action> -- it's done; 50% search[a-b/c]",
    "$5 #1 {x} (a) 'q' <remark>why?</remark>\n\n<action>BET</action>",
]


def test_word_level_save_hf_is_the_same_tokenizer_for_auto_tokenizer(tmp_path):
    """Same ids, same chat prompt, same decoded text (transformers drops [UNK] as a special token when
    asked to skip them, so the texts here are inside the vocabulary)."""
    from transformers import AutoTokenizer

    word_tok = Tokenizer.word_level(EXPORT_TEXTS)
    word_tok.save_hf(tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (word_tok.bos_id, word_tok.eos_ids[0],
                                                                     word_tok.pad_id)
    for text in EXPORT_TEXTS:
        [ours] = word_tok.encode_prompts([text])
        assert hf(text)["input_ids"] == ours
        assert hf.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                      return_dict=False) == ours
        response = [*word_tok.encode(text), word_tok.eos_ids[0]]
        assert hf.decode(response, skip_special_tokens=True) == word_tok.decode(response)


def test_hf_save_hf_writes_a_folder_auto_tokenizer_loads(hf_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = Tokenizer.from_hf_dir(hf_dir)
    tok.save_hf(tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert hf(CORPUS[0], add_special_tokens=False)["input_ids"] == tok.encode(CORPUS[0])
    assert hf.chat_template == tok.backend.chat_template


# ----------------------------------------------------------------------------- incremental prompts
def environment_prompts(name, tmp_path):
    """The prompts of a short random-legal rollout of ``name``, in the order the runner made them."""
    options, opponents = {}, None
    if name == "alfworld":
        require("alfworld")
        require("textworld")
        options = {"split": "valid_unseen",
                   "data_dir": write_tiny_alfworld_data(tmp_path, splits=("valid_unseen",), trials=2)}
    if name in ("kuhn_poker", "tic_tac_toe"):
        opponents = {"random": 1} if name == "tic_tac_toe" else {"conservative": 1, "aggressive": 1}
    tasks = TaskSampler(TaskSamplerConfig(num_tasks=2, group_size=2, opponents=opponents,
                                          seats="mixed" if opponents else "first")).sample_train(0)
    config = runner_config(num_episodes=3, constrained_actions=True, memory_mode="history_only",
                           reflect=False, keep_text=True)
    rows = MetaEpisodeRunner(name, options, config).run(tasks, RandomLegalPolicy(0), training=False).rows
    return [r.prompt_text for r in rows]


@pytest.mark.parametrize("name", ["kuhn_poker", "tic_tac_toe", "sokoban", "minesweeper", "webshop",
                                  "alfworld"])
def test_prompt_encoder_gives_the_whole_text_ids_on_every_environment(name, tmp_path, hf_dir):
    """A meta-episode's prompts share a growing prefix; the word-level encoder tokenizes only what a prompt
    adds to the closest earlier one, and its ids are those of tokenizing each whole prompt (a vocabulary
    from half the prompts, so unknown words occur too). The HF tokenizer (byte-level BPE) encodes whole
    prompts, the same ids by construction."""
    prompts = environment_prompts(name, tmp_path)
    assert len(prompts) >= 6
    word = Tokenizer.word_level(prompts[::2], vocab_size=4096)
    for tokenizer in (word, Tokenizer.from_hf_dir(hf_dir)):
        encoder = PromptEncoder(tokenizer)
        assert encoder.incremental == (tokenizer.kind == "word_level")
        got = []
        for i in range(0, len(prompts), 3):  # batches in rollout order, as the policy sends them
            got += encoder.encode_prompts(prompts[i:i + 3])
        whole = tokenizer.encode_prompts(prompts)
        assert got == whole
        if encoder.incremental:  # most ids came from earlier prompts
            assert encoder.reused_tokens > 0.5 * sum(len(ids) for ids in whole[3:])


def test_prompt_encoder_cuts_only_after_spaces_tabs_and_newlines(word_tok):
    """Shared prefixes that end inside a word, a number, a tag or a run of spaces, non-ASCII text, a
    prompt that is a prefix of another, repeats and an empty prompt: the ids are the whole-text ids."""
    texts = ["Your card is K.\tLegal:  PASS, BET.\n\n<action>PASS</action> 3.25 √√ board",
             "Your card is K.\tLegal:  PASS, BET.\n\n<action>PASS</action> 3.5 √ boards",
             "Your card is K.\tLegal:  PASS, BET.\n\n<act",
             "Your card is K.\tLegal:  PASS, BET.\n\n<action>BET</action>",
             "Your card is K.\tLegal:  PA",
             "Your card is K.\tLegal:   PASS",
             "Your card is K.\tLegal:  PASS, BET.\n\n<action>PASS</action> 3.25 √√ board",
             "", "Your card", "\n\n  Your card is Q."]
    encoder = PromptEncoder(word_tok)
    assert encoder.incremental
    got = [ids for text in texts for ids in encoder.encode_prompts([text])]
    assert got == word_tok.encode_prompts(texts) and encoder.reused_tokens > 0


def test_prompt_encoder_encodes_whole_texts_for_another_pre_tokenizer(word_tok):
    """A word-level tokenizer whose pre-tokenizer is not the built-in one (e.g. a changed saved file) is
    not assumed to split at spaces: whole texts, as ``encode_prompts``."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import pre_tokenizers

    raw = RawTokenizer.from_str(word_tok.backend.to_str())
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    other = Tokenizer._from_raw_word_level(raw, source=None)
    assert not PromptEncoder(other).incremental
