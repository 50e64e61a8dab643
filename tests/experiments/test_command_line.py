"""The command line as a researcher meets it: every mistake, early or late, is one ``error:`` line with
exit status 2 and leaves no run directory behind (so the corrected command is not refused)."""

from __future__ import annotations

import pytest

from experiments import alfworld, kuhn_poker, sokoban, tic_tac_toe, webshop


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
