"""Plots write PNG files (headless) and refuse inputs they cannot draw with one clear error."""

import json

import pytest

from mage_jax.evaluation.evaluator import SplitResult
from mage_jax.evaluation.metrics import compute_metrics
from mage_jax.evaluation.plots import (
    Selection,
    plot_episode_curves,
    plot_success_and_payoff,
    plot_training_curves,
)
from mage_jax.evaluation.report import results_table, write_plots
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
    records += [{"iteration": i, "split": "eval", "success@1": 0.1 * i} for i in (0, 4)]
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
    records += [{"iteration": i, "split": split, "success@1": 0.0, "success@2": 0.25 * i}
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


def test_the_final_evaluation_is_drawn_at_the_state_it_measured_which_is_marked(tmp_path, figures):
    """Final evaluation records are logged at the last iteration (3) but measure the best validated state
    (iteration 2); an evaluation during training (iteration 1) measured its own iteration."""
    log = tmp_path / "metrics.jsonl"
    records = [{"iteration": i, "split": "train", "success@last": 0.1 * i, "policy_loss": 1 / i}
               for i in (1, 2, 3)]
    records += [{"iteration": i, "split": "validation", "success@1": 0.0, "success@2": 0.2 * i}
                for i in (1, 2, 3)]
    records += [{"iteration": 1, "split": "eval", "success@1": 0.0, "success@2": 0.1}]
    records += [{"iteration": 3, "split": split, "success@1": 0.0, "success@2": 0.6}
                for split in ("eval", "heldout")]
    log.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    plot_training_curves(log, tmp_path / "train.png", keys=["success@last", "policy_loss"],
                         selection=Selection(logged_at=3, state_of=2))
    [fig] = figures
    success_ax, loss_ax = fig.axes[:2]
    lines = {line.get_label(): line for line in success_ax.get_lines()}
    assert list(lines["eval"].get_xdata()) == [1.0, 2.0] and list(lines["heldout"].get_xdata()) == [2.0]
    assert list(lines["validation"].get_xdata()) == [1.0, 2.0, 3.0]  # each measured its own iteration
    assert list(lines["train"].get_xdata()) == [1.0, 2.0, 3.0]
    for ax in (success_ax, loss_ax):  # every panel marks the selected iteration
        [mark] = [line for line in ax.get_lines() if "selected state" in line.get_label()]
        assert list(mark.get_xdata()) == [2, 2] and "iteration 2" in mark.get_label()
    assert any("selected state, iteration 2" in t.get_text() for t in fig.legends[0].get_texts())
    # points of two splits at one place both show: different markers, the later ones hollow
    assert lines["eval"].get_marker() != lines["heldout"].get_marker()
    assert lines["heldout"].get_markerfacecolor() == "none"


def test_training_panels_have_y_axis_labels(tmp_path, figures):
    log = tmp_path / "metrics.jsonl"
    keys = ["success@last", "payoff@last", "entropy_play@1", "private_dependence", "grad_norm", "new_metric"]
    log.write_text(json.dumps({"iteration": 1, "split": "train", **{k: 0.5 for k in keys}}) + "\n")
    plot_training_curves(log, tmp_path / "train.png", keys=keys)
    [fig] = figures
    labels = [ax.get_ylabel() for ax in fig.axes[:len(keys)]]
    assert labels[0] == "share of meta-episodes won" and labels[1].startswith("payoff")
    assert labels[2].startswith("nats") and labels[3] == "total-variation distance"
    assert labels[5] == "new_metric"  # an unknown key names itself
    assert all(labels)


def test_success_plot_draws_each_opponents_ceiling_in_its_colour(tmp_path, figures):
    group = {"success": {"aggressive": {"ceiling": 0.5}, "conservative": {"ceiling": 1.0}}}
    plot_success_and_payoff(metrics(), tmp_path, reference={"success": {"ceiling (winnable)": 0.75}},
                            prefix="eval_", group_reference=group)
    success, payoff = figures
    lines = {line.get_label(): line for line in success.axes[0].get_lines()}
    for name, ceiling in (("aggressive", 0.5), ("conservative", 1.0)):
        mark = lines[f"{name} ceiling = {ceiling:.3g}"]
        assert list(mark.get_ydata()) == [ceiling, ceiling]
        assert mark.get_color() == lines[f"{name} (1)"].get_color()
    assert not any("ceiling" in line.get_label() for line in payoff.axes[0].get_lines())


def one_opponent_metrics():
    outcomes = [MetaEpisodeOutcome(i, i, i, "cfr", 1, rewards=[-5.0, 5.0], won=[False, i % 2 == 0],
                                   payoff=[-1.0, 1.0 if i % 2 == 0 else -1.0]) for i in range(4)]
    return compute_metrics(outcomes, num_episodes=2)


def test_a_one_opponent_split_names_its_opponent_and_seat_and_draws_no_hidden_lines(tmp_path, figures):
    reference = {"payoff": {"random": [-0.9, -0.9], "best fixed by payoff": -0.5, "adaptive bound": -0.5}}
    plot_success_and_payoff(one_opponent_metrics(), tmp_path, reference=reference, prefix="heldout_")
    success, payoff = figures
    title = payoff.axes[0].get_title()
    assert "opponent cfr" in title and "seat 1 (second to act)" in title and "heldout split" in title
    ax = payoff.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    # one curve (the overall mean is the opponent's), equal references as one line with both names
    assert labels == ["cfr (4)", "random", "best fixed by payoff = adaptive bound = -0.5"]
    drawn = [(tuple(line.get_xdata()), tuple(line.get_ydata())) for line in ax.get_lines()]
    assert len(drawn) == len(set(drawn)) == 3  # no line lies on another


def test_run_plots_draw_the_tables_best_fixed_strategy_under_one_name_per_quantity(tmp_path, figures):
    """The success plot's best fixed strategy is the table's fix:win (best by wins), the payoff plot's
    the table's fix:pay (best by payoff); the payoff-best strategy's success is drawn nowhere."""
    m = metrics()
    reference = {"winnable": 1.0, "random_success": [0.3, 0.4, 0.5], "random_payoff": [-0.5, -0.4, -0.3],
                 "best_fixed_success": [0.1, 0.1, 0.1], "best_fixed_payoff": [0.25, 0.25, 0.25],
                 "best_fixed_by_success_success": [0.7, 0.7, 0.7], "best_fixed_by_success_payoff": [0.0] * 3,
                 "adaptive_payoff_bound": [0.5, 0.5, 0.5],
                 "by_opponent": {"aggressive": {"winnable": 0.5}, "conservative": {"winnable": 1.0}}}
    write_plots(str(tmp_path), {"eval": SplitResult(m, reference)})
    success, payoff = figures[:2]
    s_lines = {line.get_label(): list(line.get_ydata()) for line in success.axes[0].get_lines()}
    p_lines = {line.get_label(): list(line.get_ydata()) for line in payoff.axes[0].get_lines()}
    assert s_lines["best fixed by wins"] == [0.7, 0.7, 0.7]
    assert p_lines["best fixed by payoff"] == [0.25, 0.25, 0.25]
    assert not any(values == [0.1, 0.1, 0.1] for values in s_lines.values())
    assert "aggressive ceiling = 0.5" in s_lines and "ceiling (winnable) = 1" in s_lines
    table = results_table({"evaluation": {"eval": {"metrics": m, "reference": reference}}}).splitlines()
    header = next(line for line in table if line.startswith("opponent")).split()
    row = next(line for line in table if line.startswith("all")).split()
    assert "fix:win" in header and "fix:pay" in header and "bestfix" not in header
    assert row[-4:-3] == ["0.700"] and row[-2:-1] == ["+0.250"]  # fix:win and fix:pay as plotted
