"""results/study_tables.py: the Student-t quantile and interval against hand-computed values, the
collapse count, the refusal to mix commits in one table, and the GPU study's tables on a synthetic
folder (and "not run" without one)."""

import importlib.util
import json
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location(
    "study_tables", os.path.join(ROOT, "results", "study_tables.py")
)
study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study)

# t(0.975, df) from printed tables of Student's t
T_975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 7: 2.3646, 30: 2.0423}


@pytest.mark.parametrize("df", sorted(T_975))
def test_the_t_quantile_matches_the_printed_table(df):
    assert study.t_quantile(0.975, df) == pytest.approx(T_975[df], abs=1e-4)


def test_the_two_sided_t_probability_has_the_cauchy_and_two_df_closed_forms():
    # df = 1 is the Cauchy distribution: P(|T| <= t) = (2 / pi) atan(t); df = 2: t / sqrt(t^2 + 2)
    for t in (0.3, 1.0, 4.0):
        assert study.t_within(t, 1) == pytest.approx(2 / math.pi * math.atan(t), rel=1e-12)
        assert study.t_within(t, 2) == pytest.approx(t / math.sqrt(t * t + 2), rel=1e-12)


def test_the_t_interval_of_four_values_is_the_hand_computed_one():
    # mean 2.5, s = sqrt(5 / 3), half-width t(0.975, 3) * s / 2 = 3.182446 * 1.290994 / 2 = 2.054255
    low, high = study.t_interval([1.0, 2.0, 3.0, 4.0])
    assert low == pytest.approx(2.5 - 2.054255, abs=1e-5)
    assert high == pytest.approx(2.5 + 2.054255, abs=1e-5)


def test_bad_arguments_to_the_t_functions_are_one_line_errors():
    with pytest.raises(ValueError, match="at least 2"):
        study.t_interval([0.5])
    with pytest.raises(ValueError, match="df=0"):
        study.t_quantile(0.975, 0)


def test_a_seed_collapses_below_a_late_reward_of_one_tenth_only():
    late = {0: 0.5, 1: 0.05, 2: 0.1, 3: 0.0999, 4: 0.0}
    assert study.collapsed_seeds(late) == [1, 3, 4]
    assert study.collapse_cell(late) == "3 (seeds 1, 3, 4)"
    assert study.collapse_cell({5: 0.02, 6: 0.7}) == "1 (seed 5)"
    assert study.collapse_cell({0: 0.7}) == "0"


def write_run(
    path, late, final_pass, gap, commit="a" * 40, dirty=False, steps=600, seed=0, start_pass=0.2
):
    """A run folder as train.py writes it: steps 1-300 at reward 0.25, steps 301-`steps` at `late`,
    pass@1 `final_pass` at the last step, a constant mean |delta logp|, and a config.json with one
    provenance entry."""
    os.makedirs(path)
    records = [{"step": 0, "pass@1": start_pass, "pass@1_bf16_trainer": start_pass}]
    for step in range(1, steps + 1):
        records.append(
            {
                "step": step,
                "reward": 0.25 if step <= 300 else late,
                "mismatch/abs_diff_mean": gap,
            }
        )
    records[-1].update({"pass@1": final_pass, "pass@1_bf16_trainer": final_pass})
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    config = {
        "preset": "small",
        "difficulty": 15,
        "steps": 600,
        "prompts_per_step": 32,
        "group_size": 8,
        "lr": 2e-5,
        "warmstart_steps": 200,
        "eval_prompts": 512,
        "seed": seed,
        "provenance": [
            {
                "from_step": 0,
                "commit": commit,
                "dirty": dirty,
                "python": "3.11.9",
                "torch": "2.11.0+cu130",
                "triton": "3.6.0",
                "device": "NVIDIA H200",
            }
        ],
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def test_a_table_refuses_runs_of_two_commits_unless_its_caption_says_why(tmp_path):
    paths = [
        write_run(tmp_path / "bf16_s0", 0.7, 0.7, 0.0, commit="1" * 40),
        write_run(tmp_path / "bf16_s1", 0.7, 0.7, 0.0, commit="2" * 40),
    ]
    with pytest.raises(SystemExit) as stop:
        study.caption("a table", paths)
    message = str(stop.value.code)
    assert "1111111" in message and "2222222" in message and "\n" not in message
    text = study.caption("a table", paths, mixes="the two commits compute the same numbers.")
    assert max(len(line) for line in text.splitlines()) <= 100
    text = " ".join(text.split())
    assert "Mixes commits 1111111, 2222222: the two commits compute the same numbers." in text
    assert "NVIDIA H200" in text and "torch 2.11.0+cu130" in text
    same = [paths[0], write_run(tmp_path / "bf16_s2", 0.7, 0.7, 0.0, commit="1" * 40)]
    assert "Mixes" not in study.caption("a table", same)


def test_uncommitted_changes_count_as_another_commit(tmp_path):
    paths = [
        write_run(tmp_path / "bf16_s0", 0.7, 0.7, 0.0, commit="1" * 40),
        write_run(tmp_path / "bf16_s1", 0.7, 0.7, 0.0, commit="1" * 40, dirty=True),
    ]
    with pytest.raises(SystemExit, match="uncommitted changes"):
        study.caption("a table", paths)


def test_runs_without_recorded_provenance_get_what_the_log_establishes():
    commits, lines = study.provenance([os.path.join(study.REPLICATION, "bf16_s0")])
    assert commits == ["f233fbb", "8d36956"]
    assert len(lines) == 1 and "not recorded" in lines[0] and "2-core" in lines[0]


def test_the_gpu_study_says_not_run_without_its_folder(tmp_path):
    text, paths = study.gpu_study(str(tmp_path / "gpu_small_600steps"))
    assert text.startswith("not run") and paths == []


def test_the_gpu_study_tables_on_a_synthetic_folder(tmp_path):
    base = tmp_path / "gpu_small_600steps"
    late = {"bf16": [0.8, 0.7, 0.9], "nvfp4": [0.5, 0.05, 0.6], "quads": [0.75, 0.6, 0.85]}
    final = {"bf16": [0.9, 0.8, 0.85], "nvfp4": [0.4, 0.0, 0.5], "quads": [0.8, 0.7, 0.9]}
    gap = {"bf16": 1e-5, "nvfp4": 3e-3, "quads": 1e-3}
    for recipe in late:
        for seed in range(3):
            write_run(
                base / f"{recipe}_s{seed}", late[recipe][seed], final[recipe][seed], gap[recipe]
            )
    write_run(base / "quads_s3", 0.8, 0.8, 1e-3, steps=300)  # stopped early: left out
    for recipe in late:  # a warm-start that solved nothing: every reward 0, the seed replaced
        write_run(base / f"{recipe}_s4", 0.0, 0.0, 1e-3, start_pass=0.0, steps=500)
    write_run(base / "bf16_s5", 0.0, 0.0, 1e-3, start_pass=0.0)  # finished, still replaced
    text, paths = study.gpu_study(str(base))
    prose = " ".join(text.split())
    assert len(paths) == 9
    assert "difficulty 15" in prose and "lr 2e-05" in prose
    assert "Left out, not at step 600: quads_s3." in prose
    assert "Replaced, by the rule in results/LOG.md: seeds 4, 5. A warm-start that" in prose
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 0 1 2 |" in rows["bf16"]  # not seed 5, though it reached step 600
    nvfp4 = [cell.strip() for cell in rows["nvfp4"].split("|")[1:-1]]
    assert nvfp4[1:7] == ["0 1 2", "1 (seed 1)", "0.383", "0.500", "0.300", "0.400"]
    assert nvfp4[7] == "3.00e-03"
    diffs = [-0.3, -0.65, -0.3]  # nvfp4 - bf16, late reward; the oracle below in float64
    center = sum(diffs) / 3
    s = math.sqrt(sum((d - center) ** 2 for d in diffs) / 2)
    half = T_975[2] * s / math.sqrt(3)
    cell = f"{center:+.3f} [{center - half:+.3f}, {center + half:+.3f}]"
    pair = [c.strip() for c in rows["nvfp4 minus bf16"].split("|")[1:-1]]
    assert pair[1:3] == [cell, "0/3"]
    assert "quads minus nvfp4" in rows
    assert pair[4].startswith(f"{3e-3 - 1e-5:+.2e} [")  # nvfp4 - bf16 mean |delta logp|
    # -0.417 on average, but 3 seeds this spread leave the interval across 0
    assert f"not met ({cell}, 3 seeds)" in prose


def test_the_failure_verdict_needs_the_interval_to_exclude_zero():
    assert "not met" in study.failure_verdict([-0.5, 0.1, -0.4])  # mean -0.27, interval spans 0
    assert "not met" in study.failure_verdict([-0.05, -0.06, -0.05])  # excludes 0, less than 0.10
    assert "met: naive NVFP4 fails" in study.failure_verdict([-0.3, -0.35, -0.32])
