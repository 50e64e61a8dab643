"""A model named as on the Hugging Face Hub resolves through the local Hugging Face cache (offline: the
test builds the cache folder), and a name found nowhere is one ``error:`` line."""

from __future__ import annotations

import json

import pytest

from experiments import kuhn_poker
from experiments.common import parse_command_line
from mage_jax.config import ConfigError
from mage_jax.models.config import ModelConfig
from mage_jax.models.hub import resolve_model_path
from mage_jax.testing import SMALLEST_DECODER, build_bpe_tokenizer

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """``HF_HUB_CACHE`` holding ``tiny-org/tiny-qwen3`` the way ``hf download`` leaves it."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-qwen3"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    build_bpe_tokenizer(snapshot, ["<action>PASS</action> <action>BET</action> Your card is K."] * 4,
                        vocab_size=300)
    decoder = {**SMALLEST_DECODER, "max_position_embeddings": 40960}  # the small preset's lengths fit
    config = ModelConfig.preset("tiny", vocab_size=304, **decoder).to_hf_config()
    (snapshot / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here: the cache is all there is
    return snapshot


def test_a_hub_name_in_the_cache_resolves_to_its_snapshot_folder(hub_cache):
    assert resolve_model_path("tiny-org/tiny-qwen3") == str(hub_cache)


def test_a_local_folder_is_used_as_it_is_even_when_shaped_like_a_hub_name(hub_cache, monkeypatch):
    monkeypatch.chdir(hub_cache.parents[2].parent)  # "hub/models--tiny-org--tiny-qwen3" is a folder here
    assert resolve_model_path("hub/models--tiny-org--tiny-qwen3") == "hub/models--tiny-org--tiny-qwen3"


def test_model_path_on_the_command_line_takes_the_hub_name(hub_cache, tmp_path):
    argv = ["--preset", "small", "--model-path", "tiny-org/tiny-qwen3", "--run-dir", str(tmp_path / "run")]
    cfg, _ = parse_command_line(argv, experiment="kuhn_poker", presets=kuhn_poker.SPEC.presets,
                                default_preset=kuhn_poker.SPEC.default_preset)
    assert cfg.model.path == str(hub_cache)  # config.json records the folder the weights came from


def test_a_name_neither_a_folder_nor_cached_is_one_error_line(hub_cache, tmp_path, capsys):
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        resolve_model_path("tiny-org/not-downloaded")
    run_dir = tmp_path / "run"
    argv = ["--preset", "small", "--model-path", "tiny-org/not-downloaded", "--run-dir", str(run_dir)]
    assert kuhn_poker.main(argv) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: model path 'tiny-org/not-downloaded' is neither a local folder nor")
    assert "hf download tiny-org/not-downloaded --local-dir DIR" in line
    assert not run_dir.exists()
