"""tools/logger.py: --log-to sends the records of metrics.jsonl, as they are, to TensorBoard or W&B;
a missing package is one line before anything runs. The packages are optional, so stand-ins record
what the real ones would be handed."""

import json
import os
import sys
import types

import pytest

import train
from conftest import raises_one_line
from test_train import read_metrics, tiny_config
from tools import logger
from tools.runs import ConfigError


class FakeSummaryWriter:
    """torch.utils.tensorboard.SummaryWriter's calls, kept."""

    made = []

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.scalars = []
        self.closed = False
        FakeSummaryWriter.made.append(self)

    def add_text(self, tag, text):
        self.text = (tag, text)

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


class FakeWandbRun:
    def __init__(self, **init):
        self.init = init
        self.logged = []
        self.finished = False

    def log(self, values, step):
        self.logged.append((values, step))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_packages(monkeypatch):
    """tensorboard and wandb as importable stand-ins; -> the wandb runs made."""
    FakeSummaryWriter.made = []
    tensorboard = types.SimpleNamespace(SummaryWriter=FakeSummaryWriter)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tensorboard)
    wandb_runs = []

    def init(**kwargs):
        wandb_runs.append(FakeWandbRun(**kwargs))
        return wandb_runs[-1]

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    real_find_spec = logger.importlib.util.find_spec
    monkeypatch.setattr(
        logger.importlib.util,
        "find_spec",
        lambda name: object() if name in logger.PACKAGES.values() else real_find_spec(name),
    )
    return wandb_runs


def test_the_scalars_of_a_record_are_its_numbers_less_the_step():
    record = {"step": 3, "reward": 0.5, "mismatch/num_tokens": 40, "flag": True, "name": "x"}
    assert logger.scalars(record) == {"reward": 0.5, "mismatch/num_tokens": 40.0}


def test_a_missing_package_is_one_line_naming_the_flag_and_the_install(monkeypatch):
    monkeypatch.setattr(logger.importlib.util, "find_spec", lambda name: None)
    for kind, package in logger.PACKAGES.items():
        raises_one_line(
            lambda: train.TrainConfig(device="cpu", log_to=kind),
            "argument --log-to",
            f"{kind} needs the {package} package, which is not installed: pip install {package}",
            ConfigError,
        )
    raises_one_line(
        lambda: train.TrainConfig(device="cpu", log_to="mlflow"),
        "argument --log-to",
        "choose from tensorboard, wandb, got 'mlflow'",
        ConfigError,
    )


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_a_run_logs_every_record_of_metrics_jsonl(kind, fake_packages, tmp_path):
    run_dir = train.run(tiny_config(tmp_path, recipe="bf16", steps=2, eval_every=1, log_to=kind))
    expected = [(record["step"], logger.scalars(record)) for record in read_metrics(run_dir)]
    assert [step for step, _ in expected] == [0, 1, 2]  # the step-0 evaluation, then each step
    if kind == "tensorboard":
        (writer,) = FakeSummaryWriter.made
        assert writer.log_dir == os.path.join(run_dir, "tensorboard") and writer.closed
        sent = {}
        for name, value, step in writer.scalars:
            sent.setdefault(step, {})[name] = value
        assert [(step, sent[step]) for step in sorted(sent)] == expected
    else:
        (run,) = fake_packages
        assert run.init["name"] == "bf16" and run.init["config"]["recipe"] == "bf16"
        assert run.init["dir"] == run_dir and run.finished
        assert [(step, values) for values, step in run.logged] == expected
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["log_to"] == kind
