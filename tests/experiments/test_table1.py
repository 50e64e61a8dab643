"""Table 1: methods x environments from finished runs, with the paper's numbers."""

from __future__ import annotations

import json
import os

from experiments import table1


def _summary(success, payoff, draw=None):
    curves = {"success": success, "payoff": payoff, "draw": draw or [0.0] * len(success)}
    block = {
        "metrics": {
            "curves": curves,
            "num_meta_episodes": 8,
            "num_episodes": len(success),
            "by_opponent": {},
        },
        "reference": None,
    }
    return {
        "status": "finished",
        "iterations": 5,
        "wall_seconds": 1.0,
        "evaluation": {"mcts100_first": block, "heldout": block, "eval": block},
    }


def _write(out, env, method, seed, summary):
    path = os.path.join(out, env, method, f"seed{seed}")
    os.makedirs(path)
    with open(os.path.join(path, "summary.json"), "w") as f:
        json.dump(summary, f)


def test_collects_finished_runs_into_the_paper_style_table(tmp_path, capsys):
    out = str(tmp_path)
    _write(out, "tic_tac_toe", "mage", 0, _summary([0.2, 0.4, 0.6], [-2.0, 0.0, 2.0], [0.1, 0.2, 0.9]))
    _write(out, "tic_tac_toe", "mage", 1, _summary([0.2, 0.4, 0.8], [-2.0, 0.0, 4.0]))
    _write(out, "tic_tac_toe", "grpo", 0, _summary([0.1, 0.2, 0.3], [-5.0, -4.0, -3.0]))
    argv = [
        "--envs",
        "tic_tac_toe",
        "--methods",
        "mage,grpo,lamer",
        "--seeds",
        "0,1",
        "--out-dir",
        out,
        "--collect-only",
        "--figures-dir",
        str(tmp_path / "figs"),
    ]
    assert table1.main(argv) == 0
    text = (tmp_path / "table.md").read_text()
    assert "| mage | 0.700 ± 0.100 | 0.672 |" in text
    assert "| grpo | 0.300 | 0.219 |" in text
    assert "| lamer | not run | 0.602 |" in text
    assert "not finished on tic_tac_toe: grpo/seed1, lamer/seed0, lamer/seed1" in text
    assert "| mage | 0 | heldout | 0.200 | 0.600 | 0.100 | 0.900 | +2.000 |" in text
    assert (tmp_path / "figs" / "table1_tic_tac_toe.png").is_file()


def test_bad_lists_are_one_error_line(capsys):
    assert table1.main(["--methods", "mage,dqn"]) == 2
    assert capsys.readouterr().err.startswith("error: --methods must name some of")
    assert table1.main(["--envs", "chess"]) == 2
    assert table1.main(["--seeds", "a"]) == 2


def test_paper_preset_without_model_folder_fails_before_any_run(tmp_path, capsys):
    assert table1.main(["--preset", "paper", "--out-dir", str(tmp_path / "t")]) == 2
    assert "--model-path" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
