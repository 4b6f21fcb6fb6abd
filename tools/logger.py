"""A copy of a run's metric records for TensorBoard or Weights & Biases (train.py --log-to).

metrics.jsonl stays the record that resume, the figures and the tables read; a logger receives the
same records, as they are written (the step-0 evaluation, then one per RL step), and sends every
numeric field as a scalar at the record's step. The packages are optional: neither is a dependency
of the project, and --log-to names the one to install when it is missing, before the run starts.

    tensorboard   RUN/tensorboard/ event files (torch.utils.tensorboard; pip install tensorboard);
                  view with `tensorboard --logdir runs`
    wandb         a run of project "nvfp4-rl" named as the run directory, the config attached, its
                  files under RUN/ (pip install wandb; WANDB_MODE=offline works without network)

Left out: histograms, media, the sample completions (samples.jsonl has them), resuming a W&B run
(a resumed train.py run starts a new W&B run from its checkpoint's step).
"""

import dataclasses
import importlib.util
import os

from tools.runs import ConfigError

# --log-to's values -> the package each needs
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_available(kind):
    """A missing package is one line naming the flag and the install, before the run starts."""
    if kind is None:
        return
    package = PACKAGES[kind]
    if importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"argument --log-to: {kind} needs the {package} package, which is not installed: "
            f"pip install {package} (or leave --log-to out: metrics.jsonl has every record)"
        )


def scalars(record):
    """The numeric fields of a record, less its step (booleans and strings are not scalars)."""
    return {
        name: float(value)
        for name, value in record.items()
        if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


class TensorBoardLogger:
    def __init__(self, cfg, run_dir):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
        self.writer.add_text("config", str(dataclasses.asdict(cfg)))

    def log(self, record):
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandbLogger:
    def __init__(self, cfg, run_dir):
        import wandb

        self.run = wandb.init(
            project="nvfp4-rl", name=cfg.run_name, config=dataclasses.asdict(cfg), dir=run_dir
        )

    def log(self, record):
        self.run.log(scalars(record), step=record["step"])

    def close(self):
        self.run.finish()


LOGGERS = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger}


def open_logger(cfg, run_dir):
    """The logger --log-to names, or None without it."""
    if cfg.log_to is None:
        return None
    return LOGGERS[cfg.log_to](cfg, run_dir)
