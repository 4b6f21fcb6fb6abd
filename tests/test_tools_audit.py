"""tools/audit.py: one batch scored three ways per recipe from a run's checkpoint, written where no
earlier audit is replaced unasked; its terminal output and its command line."""

import json
import os
import shutil

import pytest
import torch

import moe
import train
from test_train import tiny_config, tree_digest
from tools import audit


def main_exit(argv, capsys):
    try:
        result = audit.main(argv)
        code = 0
    except SystemExit as stop:
        result, code = None, stop.code
    out, err = capsys.readouterr()
    return code, out, err, result


@pytest.fixture(scope="module")
def quads_run(tmp_path_factory):
    return train.run(tiny_config(tmp_path_factory.mktemp("audit"), recipe="quads"))


def test_audit_scores_one_batch_three_ways_per_recipe(quads_run, capsys):
    code, _, _, table_path = main_exit(
        [quads_run, "--recipes", "bf16,nvfp4", "--device", "cpu"], capsys
    )
    folder = os.path.join(quads_run, "audit_step3")  # the checkpoint's step
    assert code == 0 and table_path == os.path.join(folder, "audit.md")
    with open(os.path.join(folder, "audit.json")) as f:
        results = json.load(f)["recipes"]
    bf16, nvfp4 = results["bf16"], results["nvfp4"]
    # fp32 rollout and trainer: decode, prefill and the trainer agree up to summation order
    assert bf16["A-B"]["abs_diff_max"] < 1e-4 and bf16["B-C"]["abs_diff_max"] < 1e-4
    # NVFP4: a token's activation scale depends on its batch (A-B), and FP4 against a BF16 trainer
    # (B-C)
    assert nvfp4["A-B"]["abs_diff_mean"] > 1e-3 and nvfp4["B-C"]["abs_diff_mean"] > 1e-3
    assert bf16["B-B replay max"] == nvfp4["B-B replay max"] == 0.0  # one prefill is repeatable
    with open(table_path) as f:
        rows = [
            line
            for line in f.read().splitlines()
            if line.startswith("| ") and "recipe" not in line and not line.startswith("| ---")
        ]
    assert [row.split("|")[1].strip() for row in rows] == ["bf16", "nvfp4"]
    assert float(rows[1].split("|")[4]) == pytest.approx(
        nvfp4["A-B"]["abs_diff_mean"], rel=1e-2
    )  # A-B MAE
    batch = torch.load(os.path.join(folder, "batch_nvfp4.pt"), weights_only=True)
    mask = batch["loss_mask"][:, 1:]
    assert (batch["A"] - batch["B"])[mask].abs().mean().item() == pytest.approx(
        nvfp4["A-B"]["abs_diff_mean"]
    )

    # a second audit never replaces the first unasked: refused, or written where --out says
    before = tree_digest(folder)
    checkpoint = os.path.join(quads_run, "checkpoint.pt")
    code, _, err, _ = main_exit([checkpoint, "--recipes", "nvfp4", "--device", "cpu"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"{folder} holds an audit (audit.json, audit.md, batch_bf16.pt" in err
    assert tree_digest(folder) == before
    other = os.path.join(quads_run, "another")
    # a checkpoint file works as well as its run directory, and gives the same batch
    main_exit([checkpoint, "--recipes", "nvfp4", "--device", "cpu", "--out", other], capsys)
    assert torch.equal(
        torch.load(os.path.join(other, "batch_nvfp4.pt"), weights_only=True)["tokens"],
        batch["tokens"],
    )
    assert tree_digest(folder) == before
    main_exit(
        [quads_run, "--recipes", "nvfp4", "--device", "cpu", "--overwrite"], capsys
    )  # asked: replaced
    assert sorted(os.listdir(folder)) == ["audit.json", "audit.md", "batch_nvfp4.pt"]


def test_row_scales_and_batches_are_audited_and_row_scales_close_the_engines_own_gap(
    quads_run, tmp_path, capsys
):
    main_exit(
        [
            quads_run,
            "--recipes",
            "nvfp4,nvfp4+row",
            "--batches",
            "2",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ],
        capsys,
    )
    with open(tmp_path / "audit.json") as f:
        results = json.load(f)["recipes"]
    assert sorted(results) == [
        "nvfp4 (batch 1)",
        "nvfp4 (batch 2)",
        "nvfp4+row (batch 1)",
        "nvfp4+row (batch 2)",
    ]
    for batch in (
        1,
        2,
    ):  # per row, decode and prefill round each token alike: A - B at the fp32 order
        tensor, row = results[f"nvfp4 (batch {batch})"], results[f"nvfp4+row (batch {batch})"]
        assert tensor["A-B"]["abs_diff_mean"] > 1e-3 and row["A-B"]["abs_diff_max"] < 1e-4
        assert (
            row["A-C"]["abs_diff_mean"] > 1e-3
        )  # the BF16 trainer still computes another function
    assert os.path.isfile(tmp_path / "batch_nvfp4+row_2.pt")


def test_audit_builds_the_symmetric_recipes_as_training_does(quads_run, tmp_path, capsys):
    """moeresq's trainer takes the rollout's RAC masks and trace's the codes its rollout recorded:
    so moeresq's trainer equals the rollout's prefill (B = C), and trace's follows its decode
    (C ~ A)."""
    main_exit(
        [quads_run, "--recipes", "moeresq,trace", "--device", "cpu", "--out", str(tmp_path)], capsys
    )

    def gaps(recipe):
        batch = torch.load(tmp_path / f"batch_{recipe}.pt", weights_only=True)
        mask = batch["loss_mask"][:, 1:]
        return {
            pair: (batch[pair[0]] - batch[pair[1]])[mask].abs().mean().item()
            for pair in ("AB", "BC", "AC")
        }

    moeresq, trace = gaps("moeresq"), gaps("trace")
    assert moeresq["AB"] > 1e-3 and moeresq["BC"] < 1e-5
    assert trace["AB"] > 1e-3 and trace["AC"] < 0.2 * trace["AB"]


def test_outlier_figures_match_hand_computed_values():
    """A row of ones with one entry 30,000 and a row from 0.5 to 1: max/RMS, block-amax ratio and
    the blocks whose E4M3 scale (448 * block amax / tensor amax) is below 2^-6, by hand; ones
    quantize exactly."""
    x = torch.stack((torch.ones(32), torch.linspace(0.5, 1.0, 32)))
    x[0, 0] = 30000.0
    stats = audit.outlier_stats(x)
    rms = ((31 + 30000.0**2 + sum((0.5 + i / 62) ** 2 for i in range(32))) / 64) ** 0.5
    assert stats["max/rms"] == pytest.approx(30000.0 / rms, rel=1e-6)
    # block amaxes (3e4, 1; 0.74, 1): the lower median is 1
    assert stats["block amax max/median"] == 30000.0
    assert stats["blocks below 2^-6"] == 0.75  # 448 * b / 3e4 < 2^-6 for every b <= 1
    row_only = audit.outlier_stats(torch.ones(3, 32))
    assert row_only["rel. error tensor"] == row_only["rel. error row"] == 0.0
    # row 1 no longer shares the 3e4's scale
    assert stats["rel. error row"] < stats["rel. error tensor"]


def test_outliers_reports_each_quantized_input_and_keeps_earlier_reports(
    quads_run, tmp_path, capsys
):
    code, out, _, path = main_exit(
        [quads_run, "--outliers", "--device", "cpu", "--out", str(tmp_path)], capsys
    )
    assert code == 0 and path == str(tmp_path / "outliers.md")
    assert out.splitlines()[-1] == f"written: {path}"  # the report says where it is
    with open(path) as f:
        rows = [line.split("|")[1].strip() for line in f if line.startswith("| layers.")]
    assert rows == [
        f"layers.{i}.{name}"
        for i in range(moe.PRESETS["tiny"].n_layers)
        for name in (
            "attn.q_proj (+2 sharing it)",
            "attn.o_proj",
            "mlp.experts",
            "mlp.experts (down)",
        )
    ]
    code, _, err, _ = main_exit(
        [quads_run, "--outliers", "--device", "cpu", "--out", str(tmp_path)], capsys
    )
    assert code == 2 and f"{tmp_path} holds an audit (outliers.md)" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["RUN", "--recipes", "bf16,int3"], "argument --recipes: choose from bf16"),
        (
            ["RUN", "--recipes", "bf16,"],
            f"argument --recipes: choose from {', '.join(train.RECIPES)}, each "
            "optionally with +row, got ''",
        ),
        (["RUN", "--recipes", "nvfp4+col"], "argument --recipes: choose from bf16"),
        (["RUN", "--batches", "0"], "argument --batches: must be an integer >= 1, got 0"),
        (
            ["RUN", "--outliers", "--batches", "2"],
            "argument --batches: the outlier report scores one batch",
        ),
        (["/nonexistent/run"], "argument RUN: no checkpoint at '/nonexistent/run'"),
        (["RUN", "--device", "tpu"], "argument --device: choose from cpu, cuda, cuda:N, got 'tpu'"),
    ],
)
def test_a_bad_value_exits_2_with_one_line_naming_it(argv, message, quads_run, capsys):
    before = tree_digest(quads_run)
    code, out, err, _ = main_exit([quads_run if a == "RUN" else a for a in argv], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("python -m tools.audit: error: ")
    assert message in err and out == ""
    assert tree_digest(quads_run) == before


def test_an_unreadable_checkpoint_is_one_line_naming_the_file(quads_run, tmp_path, capsys):
    for name, damage in (
        ("truncated", lambda path: open(path, "r+b").truncate(os.path.getsize(path) // 2)),
        ("foreign", lambda path: torch.save({"weights": torch.ones(2)}, path)),
    ):
        run_dir = tmp_path / name
        shutil.copytree(quads_run, run_dir)
        damage(run_dir / "checkpoint.pt")
        code, _, err, _ = main_exit([str(run_dir), "--device", "cpu"], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert f"cannot read the checkpoint {run_dir}/checkpoint.pt" in err
        assert "give another run" in err


def test_the_terminal_gets_a_compact_table_and_the_paths_the_full_one_is_in_audit_md(
    quads_run, tmp_path, capsys
):
    out_dir = tmp_path / "compact"
    code, out, _, table_path = main_exit(
        [quads_run, "--device", "cpu", "--out", str(out_dir)], capsys
    )
    assert code == 0
    lines = out.splitlines()
    assert max(len(line) for line in lines if str(out_dir) not in line) <= 100  # paths aside
    start = next(i for i, line in enumerate(lines) if line.startswith("recipe"))
    lines = lines[start:]  # below the header sentence, wrapped
    assert lines[0].split() == ["recipe", "tokens"] + [
        word for pair in ("A-B", "B-C", "A-C") for name in ("MAE", "max") for word in (pair, name)
    ] + ["B-B'", "max"]
    with open(out_dir / "audit.json") as f:
        results = json.load(f)["recipes"]
    for line, recipe in zip(lines[1:4], ("bf16", "nvfp4", "quads")):
        cells = line.split()
        assert cells[0] == recipe and int(cells[1]) == results[recipe]["tokens"]
        assert float(cells[4]) == pytest.approx(results[recipe]["B-C"]["abs_diff_mean"], rel=1e-2)
        assert float(cells[5]) == pytest.approx(results[recipe]["B-C"]["abs_diff_max"], rel=1e-2)
    assert lines[4] == f"full table (p95, p99, signed mean too): {table_path}"
    assert str(out_dir / "audit.json") in lines[5] and "batch_<recipe>.pt" in lines[5]
    with open(table_path) as f:
        full_header = [line for line in f if line.startswith("| recipe")][0]
    assert full_header.count("|") == 2 + 3 * len(audit.STATS) + 1 + 1  # every statistic


def test_recipes_without_rac_are_audited_from_a_run_with_its_own_rac_ratio(tmp_path, capsys):
    run_dir = train.run(tiny_config(tmp_path, recipe="quads", rac_ratio=0.25, steps=1))
    code, out, err, _ = main_exit([run_dir, "--recipes", "bf16,quads", "--device", "cpu"], capsys)
    assert code == 0, err
    with open(os.path.join(run_dir, "audit_step1", "audit.json")) as f:
        audited = json.load(f)
    assert set(audited["recipes"]) == {"bf16", "quads"}
    assert audited["config"]["rac_ratio"] == 0.25  # the run's own, for the recipe with RAC
