"""README.md's Quick start, run as a new user would: its commands top to bottom, as written, in a
fresh copy of the tracked tree, with short step counts appended to the training commands. Skipped:
the installs, the test suite itself (this is part of it), a command naming a placeholder path
(path/to/...), and the GPU benchmark without a GPU. Each command must exit 0; the outputs the README
promises must be where it says."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a tiny run: the README's commands as they are, made quick
SHORT = [
    "--steps",
    "2",
    "--warmstart-steps",
    "20",
    "--prompts-per-step",
    "2",
    "--group-size",
    "2",
    "--eval-prompts",
    "4",
    "--difficulty",
    "1",
]


def quick_start_commands():
    """The commands of the Quick start's bash blocks, in order, without their comments."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            for command in line.split("&&"):
                if command.strip():
                    commands.append(command.strip())
    return commands


def skipped(command):
    if command.startswith(("pip ", "ruff ", "python -m pytest")):
        return True
    if "path/to/" in command:
        return True
    return "bench.py" in command and not torch.cuda.is_available()


def fresh_copy(destination):
    """The tracked files of the working tree, as a clone would have them (and nothing else)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    for name in filter(None, listed.split("\0")):
        target = os.path.join(destination, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(REPO, name), target)


def test_the_quick_start_lists_the_commands_this_test_runs():
    commands = quick_start_commands()
    assert commands[0].startswith("pip install torch --index-url")  # the CPU install first
    assert "python train.py" in commands
    run = [c for c in commands if not skipped(c)]
    assert run[0] == "python train.py" and len(run) >= 8


@pytest.mark.slow
def test_the_quick_start_runs_top_to_bottom_in_a_fresh_copy(tmp_path):
    if shutil.which("git") is None or not os.path.exists(os.path.join(REPO, ".git")):
        pytest.skip("not a git checkout: no list of tracked files to copy")
    fresh_copy(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    timings = []
    for command in quick_start_commands():
        if skipped(command):
            continue
        words = shlex.split(command)
        words[0] = sys.executable
        if command.startswith(("python train.py", "python -m tools.compare")):
            words += SHORT
        start = time.perf_counter()
        done = subprocess.run(
            words, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
        )
        timings.append((command, time.perf_counter() - start))
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
        if command.startswith("python -m tools.compare"):
            # the comparisons reuse the warm-start the first run cached, whatever their --out-dir
            assert "warm-start: loaded runs/warmstart/" in done.stdout, done.stdout[-2000:]
    print("\n".join(f"{seconds:6.1f} s  {command}" for command, seconds in timings))
    runs = tmp_path / "runs"
    for promised in (
        "quads/curves.png",
        "quads/samples.jsonl",
        "nvfp4+tis2+r3/checkpoint.pt",
        "quads+dim=128,head_dim=32,expert_dim=128/checkpoint.pt",
        "paper/compare_bf16_nvfp4_quads.png",
        "paper/compare_rac@0_rac@0.25_rac@0.5_rac@1.md",
        "quads/audit_step2/audit.md",
        "quads/audit_step2/outliers.md",
    ):
        assert (runs / promised).exists(), promised
