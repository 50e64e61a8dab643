"""The command line as a researcher meets it: every mistake, early or late, is one ``error:`` line with
exit status 2 and leaves no run directory behind (so the corrected command is not refused)."""

from __future__ import annotations

import json
import shutil

import pytest

from experiments import alfworld, baselines, evaluate, kuhn_poker, sokoban, table1, tic_tac_toe, webshop
from experiments.environments import environment
from mage_jax import config as C


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: ")
    return err[0]


@pytest.mark.parametrize(
    "main, argv, message",
    [
        (kuhn_poker.main, ["--env.opponents", "a,b,c"], "unknown Kuhn Poker opponent 'a'"),
        (kuhn_poker.main, ["--env.heldout_opponent", "nobody"], "unknown Kuhn Poker opponent 'nobody'"),
        (tic_tac_toe.main, ["--env.opponents", "conservative,aggressive,intermediate",
                            "--env.opponent_ratios", "0.3,0.3,0.4"],
         "unknown Tic-Tac-Toe opponent 'conservative'"),
        (kuhn_poker.main, ["--env.opponent_ratios", "0,0,1"], "needs a positive pool ratio"),
        (webshop.main, ["--env.options", '{"bogus": 1}'], "env webshop: "),
        (alfworld.main, ["--env.data_dir", "/nonexistent/alfworld"],
         "env alfworld: ALFWorld data not found"),
        (sokoban.main, ["--env.opponents", "cfr", "--env.opponent_ratios", "1"],
         "env sokoban has no opponents"),
        (kuhn_poker.main, ["--mesh.data", "3"], "error: mesh: "),
        # found after the word-level tokenizer was built and saved in the run directory
        (kuhn_poker.main, ["--model.overrides", '{"num_heads": 3}', "--tokenizer.corpus_meta_episodes", "4"],
         "error: model: num_heads=3 is not a multiple"),
    ],
)
def test_a_late_config_error_is_one_line_and_leaves_no_run_directory(tmp_path, capsys, main, argv, message):
    run_dir = tmp_path / "run"
    assert main([*argv, "--run-dir", str(run_dir), "--logging.progress", "false"]) == 2
    assert message in one_error_line(capsys)
    assert not run_dir.exists()


def test_a_late_error_in_an_existing_empty_folder_removes_only_what_the_run_created(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    argv = ["--model.overrides", '{"num_heads": 3}', "--tokenizer.corpus_meta_episodes", "4"]
    assert kuhn_poker.main([*argv, "--run-dir", str(run_dir), "--logging.progress", "false"]) == 2
    one_error_line(capsys)
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("where, message", [("file/run", "is a file"), ("file", "is a file, not a folder")])
def test_a_run_dir_that_cannot_be_a_folder_is_one_line(tmp_path, capsys, where, message):
    (tmp_path / "file").write_text("")
    assert kuhn_poker.main(["--run-dir", str(tmp_path / where)]) == 2
    assert message in one_error_line(capsys)


def test_the_tiny_preset_with_a_pretrained_model_folder_is_refused(tmp_path, capsys, tiny_hf_model):
    run_dir = tmp_path / "run"
    argv = ["--preset", "tiny", "--model-path", tiny_hf_model, "--run-dir", str(run_dir)]
    assert kuhn_poker.main(argv) == 2
    line = one_error_line(capsys)
    assert "preset 'tiny'" in line and "--preset small or paper" in line
    assert not run_dir.exists()


def test_rows_longer_than_the_models_context_are_one_line_before_anything_is_written(tmp_path, capsys,
                                                                                     tiny_hf_model):
    folder = tmp_path / "short_context"
    shutil.copytree(tiny_hf_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    run_dir = tmp_path / "run"
    argv = ["--preset", "small", "--model-path", str(folder), "--run-dir", str(run_dir),
            "--rollout.max_prompt_tokens", "1000", "--rollout.max_response_tokens", "16",
            "--rollout.max_reflection_tokens", "30"]
    assert kuhn_poker.main(argv) == 2
    assert one_error_line(capsys) == (
        "error: rollout.max_prompt_tokens (1000) + the longest response (30, rollout.max_response_tokens / "
        f"max_reflection_tokens) = 1030 tokens exceed the model's max_position_embeddings (1024) in "
        f"{str(folder)!r}; lower them")
    assert not run_dir.exists()
    fits = {"model.path": str(folder), "rollout.max_prompt_tokens": 1000, "rollout.max_response_tokens": 16,
            "rollout.max_reflection_tokens": 24}
    assert environment("kuhn_poker").config("small", fits).rollout.max_new_tokens == 24  # 1024: fits


def test_list_keys_shows_type_default_the_presets_value_and_the_docstring(capsys):
    assert tic_tac_toe.main(["--list-keys"]) == 0
    out = capsys.readouterr().out.splitlines()
    lr = next(i for i, line in enumerate(out) if line.startswith("--optim.lr "))
    assert out[lr] == "--optim.lr  (float)  default: 1e-06  preset tiny: 0.001"
    data = next(i for i, line in enumerate(out) if line.startswith("--env.data_dir "))
    assert "(str or none)" in out[data]
    assert out[data + 1].strip().startswith("Local folder of the environment")
    assert sum(line.startswith("--") for line in out) == len(C.all_keys())


def test_evaluate_lists_its_keys_without_a_run(capsys):
    assert evaluate.main(["--list-keys"]) == 0
    out = capsys.readouterr().out
    assert "--train.eval_meta_episodes  (int)" in out


def test_baselines_help_names_its_module_and_its_env_and_method_flags(capsys):
    assert baselines.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m experiments.baselines")
    assert "--env ENV" in out and "--method METHOD" in out and "reflexion:" in out


def test_table1_help_explains_every_flag(capsys):
    assert table1.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--envs ENVS comma-separated environments", "--methods METHODS comma-separated methods",
                 "--seeds SEEDS comma-separated seeds", "--collect-only tabulate finished runs"):
        assert text in out
    # Python 3.13's argparse names the value once for both spellings
    assert any(f"{flags} where the runs" in out for flags in ("--out-dir OUT_DIR, --out OUT_DIR",
                                                             "--out-dir, --out OUT_DIR"))
