"""tools/plot.py on hand-written metrics: the trailing mean, the table's numbers and headers, the
figure's file, title and legend."""

import json
import os

import pytest

from tools import plot


def write_run(path, mean_gaps):
    """A run directory whose metrics.jsonl has step 0's pass@1 and one record per mean |delta
    logp|."""
    os.makedirs(path)
    records = [{"step": 0, "pass@1": 0.25, "pass@1_bf16_trainer": 0.5}]
    records += [
        {
            "step": i + 1,
            "reward": 0.5,
            "mismatch/abs_diff_mean": gap,
            "mismatch/abs_diff_max": 10 * gap,
            "mismatch/kl_k3": gap / 2,
            "routing_disagreement": 0.01 * (i + 1),
            "rollout_tokens_per_s": 1000.0,
            "step_s": 2.0,
        }
        for i, gap in enumerate(mean_gaps)
    ]
    records[-1].update({"pass@1": 0.75, "pass@1_bf16_trainer": 0.625})
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_smoothing_is_a_trailing_mean_that_starts_with_fewer_values():
    assert plot.smooth([1.0, 3.0, 5.0, 7.0], 2) == pytest.approx([1.0, 2.0, 4.0, 6.0])
    assert plot.smooth([2.0, 4.0], 10) == pytest.approx([2.0, 3.0])
    assert plot.smooth([5.0, 1.0], 1) == [5.0, 1.0]


def test_the_table_has_a_row_per_run_with_its_mismatch_averaged_over_the_last_ten_steps(tmp_path):
    gaps = [float(i) for i in range(1, 13)]  # 12 steps: the window at the end is steps 3..12
    runs = [write_run(tmp_path / "a", gaps), write_run(tmp_path / "b", [1.0] * 12)]
    lines = plot.summarize(runs, checkpoints=(5,)).splitlines()
    assert len(lines) == 2 + 2
    headers = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    assert headers == [
        "run",
        "pass@1: rollout / BF16 trainer (last evaluation)",
        "mean abs dlogp (mean of steps 1-5, the last 10 steps)",
        "max abs dlogp (largest step max of steps 1-5, the last 10 steps)",
        "routing disagreement (mean of steps 1-5, the last 10 steps)",
        "rollout tokens/s (mean)",
        "step time, s (mean)",
    ]
    cells = [cell.strip() for cell in lines[2].split("|")[1:-1]]
    assert cells[:2] == ["a", "0.750 / 0.625 (step 12)"]
    assert cells[2] == f"{sum(gaps[:5]) / 5:.2e}, {sum(gaps[2:]) / 10:.2e}"  # steps 1-5, steps 3-12
    # the max column is the largest per-step max of each window (write_run: max = 10 x the mean),
    # as the run summary's "max" is, not a mean of maxima
    assert cells[3] == f"{10 * 5.0:.3f}, {10 * 12.0:.3f}"
    assert cells[-2:] == ["1,000", "2.00"]


def test_the_figure_is_titled_with_what_the_runs_share_and_has_one_legend(tmp_path, monkeypatch):
    first = write_run(tmp_path / "quads", [1e-3, 2e-3])
    second = write_run(tmp_path / "nvfp4", [1e-3, 2e-3])
    provenance = [
        {"from_step": 0, "commit": "0123456789abcdef", "dirty": False},
        {"from_step": 1, "commit": "fedcba9876543210", "dirty": True},  # a resumed start
    ]
    for run, recipe in ((first, "quads"), (second, "nvfp4")):
        config = {"recipe": recipe, "preset": "tiny", "seed": 3, "steps": 2}
        with open(os.path.join(run, "config.json"), "w") as f:
            json.dump({**config, "provenance": provenance}, f)
    assert plot.figure_title([first]) == (
        "recipe quads, preset tiny, seed 3, steps 2, commit fedcba9+changes"
    )
    assert plot.figure_title([first, second]) == (
        "recipe various, preset tiny, seed 3, steps 2, commit fedcba9+changes"
    )
    # a run without config.json (made before it was written) leaves out what it cannot tell
    assert plot.figure_title([write_run(tmp_path / "old", [1e-3])]) == ""

    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot.plot([first, second], str(tmp_path / "two.png"))
    (figure,) = figures
    assert figure._suptitle.get_text() == plot.figure_title([first, second])
    (legend,) = figure.legends  # one, for every panel
    assert [text.get_text() for text in legend.get_texts()] == ["quads", "nvfp4"]
    assert all(ax.get_legend() is None for ax in figure.axes)


def test_one_run_gets_its_own_figure_and_several_need_a_path(tmp_path, capsys):
    run = write_run(tmp_path / "a", [1e-3, 2e-3])
    plot.main([run])
    assert os.path.getsize(os.path.join(run, "curves.png")) > 0
    with pytest.raises(SystemExit) as stop:
        plot.main([run, write_run(tmp_path / "b", [1e-3])])
    assert (
        stop.value.code == 2
        and "argument --out: required with several runs" in capsys.readouterr().err
    )
