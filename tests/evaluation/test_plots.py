"""Plots write PNG files (headless) and refuse inputs they cannot draw with one clear error."""

import json

import pytest

from mage_jax.evaluation.metrics import compute_metrics
from mage_jax.evaluation.plots import plot_episode_curves, plot_success_and_payoff, plot_training_curves
from mage_jax.rollout.meta_episode import MetaEpisodeOutcome

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def metrics():
    outcomes = [
        MetaEpisodeOutcome(
            0, 0, 0, "aggressive", 0, rewards=[-5.0, 5.0], won=[False, True], payoff=[-1.0, 1.0]
        ),
        MetaEpisodeOutcome(1, 1, 1, "conservative", 1, rewards=[5.0], won=[True], payoff=[1.0]),
    ]
    return compute_metrics(outcomes, num_episodes=3)


def is_png(path):
    return path.exists() and path.read_bytes()[:8] == PNG_MAGIC


def test_success_and_payoff_curves_per_opponent_with_reference_lines(tmp_path):
    reference = {"success": {"winnable": 0.58, "random": [0.3, 0.45, 0.56]}, "payoff": {"best fixed": 0.13}}
    paths = plot_success_and_payoff(metrics(), tmp_path / "eval", reference=reference, prefix="it10_")
    assert [p.name for p in paths] == ["it10_success.png", "it10_payoff.png"]
    assert all(is_png(p) for p in paths)


def test_an_unknown_metric_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no curve 'elo'"):
        plot_episode_curves(metrics(), tmp_path / "x.png", metric="elo")


def test_training_curves_from_a_metrics_jsonl_file(tmp_path):
    log = tmp_path / "metrics.jsonl"
    records = [
        {"iteration": i, "split": "train", "reward_mean": i / 10, "policy_loss": 1 / (i + 1)}
        for i in range(5)
    ]
    records += [{"iteration": i, "split": "eval", "success@0": 0.1 * i} for i in (0, 4)]
    log.write_text("\n".join(json.dumps(r) for r in records) + "\n{torn")
    out = plot_training_curves(log, tmp_path / "train.png")
    assert is_png(out)
    with pytest.raises(ValueError, match="none of the keys"):
        plot_training_curves(log, tmp_path / "none.png", keys=["grad_norm"])
    with pytest.raises(ValueError, match="no records"):
        plot_training_curves(tmp_path / "missing.jsonl", tmp_path / "y.png")


# -- what a reader sees: the split in the title, nothing covering the curves, integer iterations ------


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions save, kept open for inspection."""
    from mage_jax.evaluation import plots

    kept = []

    def keep(fig, path):
        fig.canvas.draw()
        kept.append(fig)
        fig.savefig(path)
        return plots.Path(path)

    monkeypatch.setattr(plots, "_save", keep)
    yield kept
    for fig in kept:
        plots._pyplot().close(fig)


def test_titles_name_the_split_and_reference_lines_sit_in_a_legend_beside_the_axes(tmp_path, figures):
    reference = {"success": {"winnable (ceiling)": 0.58, "random": [0.3, 0.45, 0.56]},
                 "payoff": {"best fixed": 0.13}}
    plot_success_and_payoff(metrics(), tmp_path, reference=reference, prefix="heldout_")
    success, payoff = figures
    ax = success.axes[0]
    assert "heldout split" in ax.get_title() and "held-out opponent" in ax.get_title()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "winnable (ceiling) = 0.58" in labels and "random" in labels
    assert not ax.texts  # no free-floating annotation that could land on a curve
    renderer = success.canvas.get_renderer()
    legend_box = ax.get_legend().get_window_extent(renderer)
    assert legend_box.x0 >= ax.get_window_extent(renderer).x1  # beside the plotting area, never on it
    plot_episode_curves(metrics(), tmp_path / "e.png", split="eval")
    assert "eval split" in figures[-1].axes[0].get_title()


def test_training_plot_has_integer_iteration_ticks_and_evaluation_points(tmp_path, figures):
    log = tmp_path / "metrics.jsonl"
    records = [{"iteration": i, "split": "train", "success@last": 0.1 * i, "policy_loss": 1 / i}
               for i in range(1, 4)]
    records += [{"iteration": i, "split": split, "success@0": 0.0, "success@1": 0.25 * i}
                for i in (2, 3) for split in ("eval", "heldout")]
    log.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    plot_training_curves(log, tmp_path / "train.png", keys=["success@last", "policy_loss"])
    [fig] = figures
    success_ax, loss_ax = fig.axes[:2]
    lines = {line.get_label(): line for line in success_ax.get_lines()}
    assert set(lines) == {"train", "eval", "heldout"}
    assert list(lines["eval"].get_xdata()) == [2.0, 3.0] and list(lines["eval"].get_ydata()) == [0.5, 0.75]
    assert lines["eval"].get_marker() == "o"
    assert [line.get_label() for line in loss_ax.get_lines()] == ["train"]
    assert len({line.get_color() for line in lines.values()}) == 3
    # one legend for the figure, above every panel, so it never covers a curve
    assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1
    renderer = fig.canvas.get_renderer()
    assert fig.legends[0].get_window_extent(renderer).y0 >= max(ax.get_window_extent(renderer).y1
                                                                for ax in fig.axes)
    for ax in (success_ax, loss_ax):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)
