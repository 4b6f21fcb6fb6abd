"""tools/runs.py: atomic writes, the run directory's refusals (a run there, a directory that cannot
be made, a resume that changes the config), the warm-start cache's place, the provenance entries,
the end-of-run summary and the command line (no abbreviations, a suggestion for a misspelt
flag)."""

import dataclasses
import hashlib
import json
import os
import re

import pytest
import torch

import train
from conftest import raises_one_line
from tools import runs


def config(where, **overrides):
    """A CPU config whose runs and warm-start cache are under `where`."""
    fields = dict(device="cpu", out_dir=str(where), warmstart_dir=str(where / "cache"))
    return train.TrainConfig(**{**fields, **overrides})


def listing(path):
    """Every path under `path`, relative to it: what a refused command must leave as it was."""
    found = []
    for root, dirs, files in os.walk(path):
        found += [os.path.relpath(os.path.join(root, name), path) for name in dirs + files]
    return sorted(found)


# ----------------------------------------------------------------------------- atomic writes
def test_atomic_save_replaces_a_file_whole_or_not_at_all(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    runs.atomic_save("first\n", path, runs.write_text)
    runs.atomic_save("second\n", path, runs.write_text)
    assert open(path).read() == "second\n"

    def crash_midway(text, target):
        with open(target, "w") as f:
            f.write(text[:3])
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        runs.atomic_save("third\n", path, crash_midway)
    assert open(path).read() == "second\n"  # the half-written copy never replaced it


# ----------------------------------------------------------------------------- the run directory
def test_a_directory_holding_a_run_is_refused_unless_resumed_or_overwritten(tmp_path):
    cfg = config(tmp_path, run_name="held")
    os.makedirs(tmp_path / "held")
    (tmp_path / "held" / "metrics.jsonl").write_text("{}\n")
    message = raises_one_line(
        lambda: runs.check_run_dir(cfg), f"{tmp_path}/held holds a run (metrics.jsonl)", "--resume"
    )
    assert "--overwrite to start it over, or choose another --run-name" in message
    assert runs.check_run_dir(dataclasses.replace(cfg, overwrite=True)) is None
    assert listing(tmp_path) == ["held", "held/metrics.jsonl"]


@pytest.mark.parametrize(
    "out_dir, problem",
    [
        ("README", "is not a directory; give a directory"),  # a file of the tree
        ("README/runs", "is not a directory; give a directory"),
        ("/dev/null/x", "cannot make /dev/null/x: /dev/null is not a directory"),
        ("/proc/x", "cannot make /proc/x: /proc takes no new entry"),
    ],
)
def test_an_out_dir_that_cannot_be_made_is_one_line_before_anything_is_written(
    tmp_path, out_dir, problem
):
    (tmp_path / "README").write_text("a file, not a directory\n")
    out_dir = str(tmp_path / out_dir) if out_dir.startswith("README") else out_dir
    cfg = config(tmp_path, out_dir=out_dir)
    raises_one_line(lambda: runs.check_run_dir(cfg), "argument --out-dir", problem)
    moved = config(tmp_path, warmstart_dir=out_dir)
    raises_one_line(lambda: runs.check_run_dir(moved), "argument --warmstart-dir", problem)
    assert listing(tmp_path) == ["README"]  # the write probe left nothing behind


def checkpoint(path, cfg, step):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {"step": step, "trainer": {}, "optimizer": {}, "config": dataclasses.asdict(cfg)}
    torch.save(state, path)


def test_resume_refuses_a_changed_config_and_a_shorter_run(tmp_path):
    cfg = config(tmp_path, run_name="run", steps=10)
    checkpoint(str(tmp_path / "run" / "checkpoint.pt"), cfg, step=6)
    resumed = dataclasses.replace(cfg, resume=True)
    assert runs.check_run_dir(resumed)["step"] == 6
    # what a run computes may not change; when it stops, and where its cache lives, may
    assert runs.check_run_dir(dataclasses.replace(resumed, steps=20, warmstart_dir="elsewhere"))
    changed = dataclasses.replace(resumed, lr=1e-3, clip_ratio_c=0.0)
    message = raises_one_line(
        lambda: runs.check_run_dir(changed), f"cannot resume {tmp_path}/run", "this command changes"
    )
    assert "--lr 0.0001 -> 0.001" in message and "--clip-ratio-c 3.0 -> 0.0" in message
    raises_one_line(
        lambda: runs.check_run_dir(dataclasses.replace(resumed, steps=5)),
        "argument --steps",
        "a run cannot be shortened (give --steps >= 6)",
    )
    raises_one_line(
        lambda: runs.check_run_dir(dataclasses.replace(resumed, run_name="other")),
        "argument --resume",
        f"no checkpoint {tmp_path}/other/checkpoint.pt to resume",
    )


def test_a_checkpoint_of_before_a_new_field_resumes_with_its_default(tmp_path):
    cfg = config(tmp_path, run_name="old", steps=10)
    checkpoint(str(tmp_path / "old" / "checkpoint.pt"), cfg, step=4)
    ckpt = torch.load(tmp_path / "old" / "checkpoint.pt", weights_only=True)
    for name in ("clip_ratio_c", "kl_coef", "eval_samples", "log_to", "warmstart_dir"):
        del ckpt["config"][name]
    torch.save(ckpt, tmp_path / "old" / "checkpoint.pt")
    resumed = dataclasses.replace(cfg, resume=True, eval_samples=None)
    assert runs.check_run_dir(resumed)["step"] == 4


# ----------------------------------------------------------------------------- the warm-start cache
def test_the_warm_start_cache_is_shared_by_out_dirs_and_moved_by_its_flag(tmp_path):
    cache = str(tmp_path / "cache")
    first = runs.warmstart_path(config(tmp_path / "one", warmstart_dir=cache))
    second = runs.warmstart_path(config(tmp_path / "two", warmstart_dir=cache))
    assert first == second and os.path.dirname(first) == str(tmp_path / "cache")
    # keyed as before the flag existed: sha1 of the key fields' values
    cfg = config(tmp_path)
    key = json.dumps({name: getattr(cfg, name) for name in runs.WARMSTART_KEY}, sort_keys=True)
    assert os.path.basename(first) == hashlib.sha1(key.encode()).hexdigest()[:12] + ".pt"
    moved = runs.warmstart_path(config(tmp_path, warmstart_dir=str(tmp_path / "moved")))
    assert moved == os.path.join(str(tmp_path / "moved"), os.path.basename(first))
    # the default sits beside the default runs, where the caches of the default out_dir always were
    assert train.TrainConfig(device="cpu").warmstart_dir == os.path.join("runs", "warmstart")


def test_a_cache_in_the_older_place_under_its_out_dir_is_still_used(tmp_path):
    cfg = config(tmp_path / "runs", warmstart_dir=str(tmp_path / "cache"))
    name = os.path.basename(runs.warmstart_path(cfg))
    earlier = tmp_path / "runs" / "warmstart" / name
    os.makedirs(earlier.parent)
    earlier.write_bytes(b"a cached policy")
    assert runs.warmstart_path(cfg) == str(earlier)
    shared = tmp_path / "cache" / name  # once the shared directory has one, it is the one
    os.makedirs(shared.parent)
    shared.write_bytes(b"a cached policy")
    assert runs.warmstart_path(cfg) == str(shared)


# ----------------------------------------------------------------------------- provenance
def test_provenance_names_the_commit_the_versions_and_the_device(tmp_path):
    entry = runs.provenance("cpu")
    assert re.fullmatch(r"[0-9a-f]{40}", entry["commit"]) and isinstance(entry["dirty"], bool)
    assert entry["torch"] == torch.__version__ and entry["python"].count(".") == 2
    assert entry["device"].startswith("cpu (") and "threads" in entry["device"]
    path = tmp_path / "config.json"
    assert runs.read_provenance(str(path)) == []  # a run's first start
    path.write_text(json.dumps({"lr": 1e-4, "provenance": [{"from_step": 0, **entry}]}))
    assert runs.read_provenance(str(path)) == [{"from_step": 0, **entry}]


# ----------------------------------------------------------------------------- the summary
def test_the_summary_gives_pass_at_k_the_mismatch_and_the_last_evaluations_first_sample(
    tmp_path,
):
    run_dir = tmp_path / "quads"
    os.makedirs(run_dir)
    records = [
        {"step": 0, "pass@1": 0.25, "pass@1_bf16_trainer": 0.5, "pass@2": 0.4, "pass@4": 0.5},
        {"step": 1, "step_s": 2.0, "mismatch/abs_diff_mean": 0.01, "mismatch/abs_diff_max": 0.5},
        {"step": 2, "step_s": 3.0, "mismatch/abs_diff_mean": 0.03, "mismatch/abs_diff_max": 0.25},
    ]
    records[-1].update({"pass@1": 0.75, "pass@1_bf16_trainer": 0.625, "pass@2": 0.875})
    records[-1].update({"pass@4": 1.0, "pass@2_bf16_trainer": 0.7})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    samples = [
        {"step": 0, "prompt": "1+2=", "completion": "early", "reward": 0.0},
        {"step": 2, "prompt": "3+4=", "completion": "3+4+0=07>7", "reward": 1.0},
        {"step": 2, "prompt": "5+6=", "completion": "wrong", "reward": 0.0},
    ]
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    cfg = config(tmp_path, run_name="quads")
    lines = runs.report(cfg, str(run_dir), "cache/ab.pt", start_step=0).splitlines()
    assert lines[0] == "quads: 2 steps; RL steps 1-2 took 5 s"
    assert lines[2] == "  pass@k        rollout pass@2 0.875, pass@4 1.000 at step 2"
    assert lines[3] == "  |delta logp|  mean 2.00e-02, max 0.500 over steps 1-2"
    assert lines[4] == "  sample        step 2, reward 1: '3+4=' -> '3+4+0=07>7'"
    assert f"  samples       {run_dir}/samples.jsonl" in lines


def test_pass_at_k_keys_are_ordered_by_k():
    record = {"pass@16": 1, "pass@2": 1, "pass@1": 1, "pass@2_bf16_trainer": 1, "reward": 1}
    assert runs.pass_at_k_keys(record) == ["pass@1", "pass@2", "pass@16"]
    assert runs.pass_at_k_keys(record, "_bf16_trainer") == ["pass@2_bf16_trainer"]


# ----------------------------------------------------------------------------- the command line
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--step", "3"], "unrecognized argument --step: did you mean --steps?"),
        (["--step=3"], "unrecognized argument --step: did you mean --steps?"),
        (["--recipie", "bf16"], "unrecognized argument --recipie: did you mean --recipe?"),
        (["--outdir", "x"], "unrecognized argument --outdir: did you mean --out-dir?"),
        (
            ["--eval", "5"],
            "unrecognized argument --eval: did you mean --eval-every, --eval-prompts or "
            "--eval-samples?",
        ),
        (["--xyzzy"], "unrecognized argument --xyzzy (see --help)"),
        (["7"], "unrecognized arguments: 7"),
    ],
)
def test_an_abbreviated_or_misspelt_flag_is_refused_with_the_nearest_names(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        train.build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err == f"train.py: error: {message}\n"


def test_every_flag_spelt_out_is_accepted():
    args = train.build_parser().parse_args(["--steps", "3", "--eval-samples", "2", "--no-r3"])
    assert (args.steps, args.eval_samples, args.r3) == (3, 2, False)
