"""tools/compare.py: variants and their run names, its command line, and a comparison from one
warm-start (sequential and in processes)."""

import os

import pytest

import train
from test_train import TINY, cli, read_metrics, tiny_config, tree_digest
from tools import compare


def main_exit(argv, capsys):
    try:
        compare.main(argv)
        code = 0
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def test_variants_set_recipe_rac_ratio_tis_and_r3_and_keep_a_given_ratio_in_the_name():
    assert compare.parse_variant("quads@0.25") == {"recipe": "quads", "rac_ratio": 0.25}
    assert compare.parse_variant("nvfp4+tis2+r3") == {"recipe": "nvfp4", "tis": 2.0, "r3": True}
    base = tiny_config("unused")
    names = [
        c.run_name for c in compare.variant_configs(base, "rac@0.125+tis3,rac@0.5,quads,nvfp4+r3")
    ]
    assert names == ["rac@0.125+tis3", "rac@0.5", "quads", "nvfp4+r3"]  # rac@0.5 is not renamed rac
    assert (
        train.TrainConfig(device="cpu", recipe="quads").run_name == "quads"
    )  # train.py's own default
    with pytest.raises(ValueError, match="cannot read variant 'quads@x'"):
        compare.parse_variant("quads@x")


def test_the_command_lines_rac_ratio_applies_to_the_variants_with_rac_only():
    base = tiny_config("unused", rac_ratio=0.3)
    configs = compare.variant_configs(base, "bf16,quads,rac@0.25")
    assert [(c.run_name, c.rac_ratio) for c in configs] == [
        ("bf16", train.TrainConfig.rac_ratio),  # nothing it applies to: the default, no refusal
        ("quads@0.3", 0.3),
        ("rac@0.25", 0.25),
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bf16", "--jobs", "0"], "argument --jobs: must be an integer >= 1, got 0"),
        ([",,,"], "argument variants: empty variant in ',,,'"),
        (
            ["bf16,fp2"],
            "argument variants: unknown recipe 'fp2' in variant 'fp2'; choose from bf16",
        ),
        (["@0.5"], "argument variants: variant '@0.5' names no recipe"),
        (
            ["rac@5"],
            "argument variants: variant 'rac@5': the RAC ratio after '@' must be in [0, 1]",
        ),
        (["nvfp4@0.25"], "argument variants: variant 'nvfp4@0.25': recipe nvfp4 has no RAC"),
        (["quads+fast"], "argument variants: cannot read variant 'quads+fast'"),
        (["quads,quads"], "argument variants: 'quads,quads' names the run 'quads' twice"),
        (
            ["quads,quads@0.5"],
            "argument variants: 'quads' and 'quads@0.5' are the same run; give it once",
        ),
        (["bf16", "--run-name", "x"], "argument --run-name: not allowed with a comparison"),
        (["bf16", "--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
        (["bf16,nvfp4", "--recipe", "fp8"], "argument --recipe: not allowed with a comparison"),
        (["bf16,nvfp4", "--recipe", "quads"], "argument --recipe: not allowed with a comparison"),
        (
            ["bf16,nvfp4", "--rac-ratio", "0.3"],
            "argument --rac-ratio: no variant of 'bf16,nvfp4' has RAC, so the value would change "
            "nothing",
        ),
        (["bf16", "--step", "3"], "unrecognized argument --step: did you mean --steps?"),
    ],
)
def test_a_bad_value_exits_2_with_one_line_naming_it_and_writes_nothing(
    argv, message, tmp_path, capsys
):
    code, out, err = main_exit(
        argv + ["--out-dir", str(tmp_path / "runs"), "--device", "cpu"], capsys
    )
    assert code == 2 and err.count("\n") == 1 and err.startswith("python -m tools.compare: error: ")
    assert message in err, err
    assert out == "" and not (tmp_path / "runs").exists()


def test_outputs_are_named_by_their_variants_and_never_replaced_unasked(tmp_path, capsys):
    assert compare.compare_paths(tiny_config(tmp_path), ["bf16", "quads@0.25+tis2"]) == (
        f"{tmp_path}/compare_bf16_quads@0.25+tis2.png",
        f"{tmp_path}/compare_bf16_quads@0.25+tis2.md",
    )
    long_names = [f"rac@0.{i}" for i in range(1, 30)]
    figure, table = compare.compare_paths(tiny_config(tmp_path), long_names)
    assert len(os.path.basename(figure)) < 60
    assert figure != compare.compare_paths(tiny_config(tmp_path), long_names[1:])[0]
    (tmp_path / "compare_bf16_quads.md").write_text("an earlier study\n")
    before = tree_digest(tmp_path)
    code, _, err = main_exit(["bf16,quads"] + cli(tmp_path), capsys)
    assert (
        code == 2
        and f"{tmp_path}/compare_bf16_quads.md exists: add --overwrite to replace it" in err
    )
    assert tree_digest(tmp_path) == before


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """bf16 and nvfp4 compared from one warm-start, one after the other."""
    out_dir = tmp_path_factory.mktemp("compare")
    return out_dir, compare.main(["bf16,nvfp4"] + cli(out_dir))


@pytest.mark.slow
def test_a_used_out_dir_is_refused_with_a_fix_the_comparison_accepts(compared, capsys):
    out_dir, _ = compared
    before = tree_digest(out_dir)
    code, _, err = main_exit(["nvfp4+tis2,bf16"] + cli(out_dir), capsys)
    assert code == 2 and err.count("\n") == 1 and f"{out_dir}/bf16 holds a run" in err
    assert "choose another --out-dir" in err and "--run-name" not in err  # which it would refuse
    assert tree_digest(out_dir) == before and not os.path.exists(
        os.path.join(out_dir, "nvfp4+tis2")
    )


@pytest.mark.slow
def test_jobs_run_variants_in_processes_and_match_the_sequential_runs(compared):
    out_dir, sequential_dirs = compared
    parallel_dir = os.path.join(out_dir, "jobs")
    os.makedirs(os.path.join(parallel_dir, "warmstart"))
    for name in os.listdir(os.path.join(out_dir, "warmstart")):  # the same warm-start
        os.link(
            os.path.join(out_dir, "warmstart", name), os.path.join(parallel_dir, "warmstart", name)
        )
    run_dirs = compare.main(["bf16,nvfp4", "--jobs", "2"] + cli(parallel_dir))
    assert [os.path.basename(d) for d in run_dirs] == ["bf16", "nvfp4"]
    for run_dir, sequential in zip(run_dirs, sequential_dirs):
        parallel, sequential = read_metrics(run_dir, True), read_metrics(sequential, True)
        assert len(parallel) == TINY["steps"]
        for key in ("reward", "mismatch/abs_diff_max"):
            assert [r[key] for r in parallel] == [r[key] for r in sequential], key
    with open(os.path.join(parallel_dir, "compare_bf16_nvfp4.md")) as f:
        assert [line.split("|")[1].strip() for line in f.read().splitlines()[2:]] == [
            "bf16",
            "nvfp4",
        ]
    assert os.path.exists(os.path.join(parallel_dir, "compare_bf16_nvfp4.png"))
