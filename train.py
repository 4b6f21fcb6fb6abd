"""GRPO with NVFP4 rollouts and BF16 training, and the two-sided fix that keeps them aligned.

    python train.py                                   # the default experiment (quads recipe)
    python train.py --recipe nvfp4 --steps 300        # the naive recipe
    python train.py --compare bf16,nvfp4,quads        # the paper's experiment, shared figures
    python train.py --compare rac@0,rac@0.25,rac@0.5,nvfp4+tis2,quads+r3   # variants: RAC ratio, TIS, R3
    python train.py --compare bf16,fp8,nvfp4,quads --jobs 4                # four processes sharing one GPU
    python train.py --model path/to/qwen3-moe --task gsm8k --recipe quads
    torchrun --nproc_per_node=8 train.py --recipe quads [--fsdp]          # every GPU of one node

One RL step, as the code below reads:

    problems  = task.sample(P, "train")                              # tasks.py
    rollout   = generate(rollout_model, prompts, G)                  # rollout.py, rollout precision
    rewards   = task.reward(problem, completion); A = advantages     # tasks.py, exact verifier; grpo.py
    old_logp  = trainer(tokens [, forced routes])                    # BF16 or QAT trainer, sampling weights
    metrics   = mismatch(old_logp, rollout.logprobs), routing disagreement       # grpo.py
    for each of N mini-batches:                                      # --minibatches N (default 1)
        loss  = grpo.policy_loss(new_logp, old_logp, A [, tis])      # ratio new/old, TIS weight old/rollout
        optimizer.step()
    sync_weights(rollout_model, trainer)                             # rac.py via nvfp4.quantize_weight
    (--mipu: keep the update only if the synced rollout policy improved; recalibrate RAC)
    log the step to metrics.jsonl; every eval_every steps pass@1; every checkpoint_every a checkpoint

Recipes: what the trainer's forward computes and what precision the rollout runs in.

    recipe   trainer forward                 rollout linear layers
    bf16     BF16                            BF16
    fp8      BF16                            FP8 W8A8
    nvfp4    BF16                            NVFP4 W4A4                (naive)
    qat      NVFP4 weights (fake-quantized)  NVFP4 W4A4                (trainer side alone)
    rac      BF16                            NVFP4 W4A4 + RAC          (rollout side alone)
    quads    as qat                          as rac                    (both sides: the stable recipe)
    w4a4     NVFP4 weights and activations   NVFP4 W4A4                (the symmetric alternative)
    moeresq  as w4a4 + the rollout's RAC     as rac                    (symmetric recovery, MoEResQ)
             on the same blocks
    trace    as w4a4, rounding to the        NVFP4 W4A4, eager decode  (rollout-guided rounding, TRACE)
             rollout's codes where close
moeresq's trainer layers hold the rollout's own RAC block masks (one selection, recalibrated for both
sides at once); trace's rollout records the codes it used for the completion tokens (hooks, hence no
CUDA-graph decode) and the trainer takes them where its value is within one E2M1 step (qat.py).

By default one update per rollout batch (fully on-policy): `old_logp` is the forward that carries the
gradient, detached, so the PPO ratio is 1 and the clip is inactive; what differs from the rollout engine
is exactly the mismatch being studied, which `--tis C` corrects per token. `--minibatches N` shuffles
the batch's rows into N mini-batches with one optimizer step each (old: one extra forward without
gradient before the first), so the ratio departs from 1 and clip-higher acts, as in QUADS, verl and
slime. `--mipu` takes the ratio against the rollout's own log-probs and keeps an update only if the
rollout model, synced with it, raises the batch's advantage-weighted likelihood (grpo.mipu_proxy);
otherwise the weights and the optimizer state are restored. `--audit RUN` scores one batch of rollout
tokens three ways per recipe (recorded at decode, re-scored in one prefill, the trainer), then exits.
Mismatch is measured on every step, on the completion tokens.

Under torchrun every rank holds a rollout model and a trainer (DDP, or FSDP2 sharded per block with
`--fsdp`), samples and scores its share of each step's prompts (whole groups), and the losses are scaled
so the averaged gradient is the one-process gradient; rank 0 alone writes. Without torchrun, one process.

Warm-start: a short supervised run on the task's (deliberately imperfect) demonstrations, cached under
out_dir/warmstart/ by everything that determines it, so every recipe and every later run with the same
settings starts from the same weights. Checkpoints are written atomically every `checkpoint_every`
steps and on Ctrl-C (held until the step being updated is finished and logged: the checkpoint is always
of a whole step); `--resume` continues with the same data order and sampling seeds (both are a
function of the step), and a NaN/Inf loss stops the run, keeping the last good checkpoint.

Runs are never destroyed unasked. A run writes out_dir/run_name/ (config.json, metrics.jsonl,
checkpoint.pt, curves.png); a directory holding metrics or a checkpoint is refused unless `--resume`
continues it (the checkpoint's stored config must match this one, except --steps, which may grow) or
`--overwrite` starts it over. Every value, the run directory, the data and the model are checked before
anything is written; what cannot run ends with one line naming the flag and the fix (exit status 2).

Device defaults: on a CPU the tiny preset and a short run (a few minutes on 2 cores); on a GPU the
small preset and the full experiment. Every field of TrainConfig is a command-line flag (see --help).
"""
import argparse
import contextlib
import copy
import dataclasses
import hashlib
import inspect
import json
import math
import multiprocessing
import os
import pickle
import random
import re
import signal
import sys
import time
import typing
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from tqdm import tqdm

import grpo
import moe
import qat
import rac
import rollout
import tasks

# recipe -> (trainer mode for qat.convert_for_training, rollout mode for rac.convert_for_rollout, RAC on)
RECIPES = {
    "bf16": ("bf16", "bf16", False),
    "fp8": ("bf16", "fp8", False),
    "nvfp4": ("bf16", "nvfp4", False),
    "qat": ("qat", "nvfp4", False),
    "rac": ("bf16", "nvfp4", True),
    "quads": ("qat", "nvfp4", True),
    "w4a4": ("w4a4", "nvfp4", False),
    "moeresq": ("moeresq", "nvfp4", True),
    "trace": ("trace", "nvfp4", False),
}


class ConfigError(ValueError):
    """A run that cannot start as asked: a bad value, a run directory it would destroy, a file it cannot
    read. One line for the user (the CLI prints it and exits 2, as argparse does); tracebacks are for bugs."""


CHOICES = {"recipe": RECIPES, "preset": moe.PRESETS, "task": tasks.TASKS}  # checked, and listed in --help


@dataclass
class TrainConfig:
    # run
    out_dir: str = "runs"          # one directory per run, and the shared warm-start cache (warmstart/)
    run_name: str = ""             # the run's directory under out_dir ("" = the recipe and its switches,
                                   # e.g. nvfp4+tis2, as --compare names its variants)
    resume: bool = False           # continue the run from its checkpoint (same config; --steps may grow)
    overwrite: bool = False        # start over where a run is (deletes its metrics and checkpoint)
    seed: int = 0                  # model init, warm-start, data order and sampling all derive from it
    device: str = ""               # cpu, cuda or cuda:N ("" = cuda if available, else cpu)
    threads: int | None = None     # torch's CPU threads (default 1 on the tiny preset: its matmuls gain
                                   # nothing from a second thread, which stalls when the other core is busy)
    checkpoint_every: int = 25     # steps between checkpoints (also written at the end and on Ctrl-C)
    cuda_graph: bool = True        # decode steps as a captured CUDA graph (GPU only)
    fsdp: bool = False             # under torchrun: shard the trainer with FSDP2 per transformer block
                                   # instead of a whole copy per GPU (DDP)
    # model and task
    preset: str | None = None      # model size (default tiny on CPU, small on GPU; none with --model)
    model: str = ""                # a Hugging Face Qwen3-MoE directory or hub id instead of a preset
                                   # (needs --task gsm8k)
    task: str = "arith"            # arith: built in, with its own tokenizer; gsm8k: needs --model
    task_source: str = ""          # gsm8k: a local .jsonl/.json/.parquet file or a hub dataset
                                   # ("" = openai/gsm8k)
    difficulty: int | None = None  # arith: digits per operand (default 2 on CPU, 3 on GPU)
    demo_error_rate: float = 0.5   # share of warm-start demonstrations with one mistake (room for RL)
    # RL
    steps: int | None = None       # RL steps (default 60 on CPU, 200 on GPU)
    prompts_per_step: int | None = None  # P, prompts per step (default 16 on CPU, 32 on GPU)
    group_size: int = 8            # G, samples per prompt: GRPO's advantages compare them
    lr: float | None = None        # AdamW learning rate of RL (default 1e-4 on the tiny preset, else 2e-5)
    temperature: float = 1.0       # sampling temperature of the rollout (the trainer's log-probs use it too)
    max_new_tokens: int | None = None  # completion length cap (default the task's longest completion + EOS)
    clip_low: float = 0.2          # PPO ratio clip below 1 - clip_low
    clip_high: float = 0.28        # PPO ratio clip above 1 + clip_high (clip-higher, as in DAPO)
    grad_clip: float = 1.0         # max global gradient norm
    minibatches: int = 1           # optimizer steps per rollout batch, each on a shuffled 1/N of its rows
    mipu: bool = False             # MIPU: ratios against the rollout's log-probs; keep an update only if the
                                   # rollout policy's proxy improves (else restore weights and optimizer)
    warmstart_steps: int | None = None  # supervised steps on demonstrations before RL
                                        # (default 300 on CPU, 1500 on GPU)
    warmstart_batch: int = 64      # demonstrations per warm-start step
    warmstart_lr: float | None = None  # warm-start peak learning rate (default 3e-3 on the tiny preset,
                                       # 1e-3 otherwise)
    eval_every: int | None = None  # steps between pass@1 evaluations (default steps // 5; also at step 0
                                   # and at the end)
    eval_prompts: int | None = None  # held-out prompts for pass@1 (default 128 on CPU, 512 on GPU)
    # recipe switches
    recipe: str = "quads"          # trainer forward and rollout precision (the table above)
    tis: float = 0.0               # truncated importance sampling cap C (0 = off; verl uses 2)
    r3: bool = False               # replay the rollout's expert routes in the trainer (R3)
    rac_ratio: float = 0.5         # fraction of activation blocks compensated by RAC (rac, quads, moeresq)
    rac_refresh: int = 1           # recalibrate the RAC block selection every N weight syncs
    # study
    compare: str = ""              # comma-separated variants recipe[@rac_ratio][+tisC][+r3]: one warm-start
                                   # and seed, shared figures
    jobs: int = 1                  # --compare: variants run at once, one process each (a small model leaves
                                   # a GPU mostly idle)
    audit: str = ""                # a run directory or checkpoint: score one rollout batch three ways per
                                   # recipe instead of training (the log-prob audit)
    audit_recipes: str = "bf16,nvfp4,quads"  # --audit: the recipes whose rollout and trainer score the batch

    def __post_init__(self):
        self._check_given()
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        _check_device(self.device)
        gpu = self.device.startswith("cuda")
        if self.preset is None and not self.model:
            self.preset = "small" if gpu else "tiny"
        tiny = self.preset == "tiny"
        defaults = dict(difficulty=(3 if gpu else 2) if self.task == "arith" else None,
                        steps=200 if gpu else 60, prompts_per_step=32 if gpu else 16,
                        lr=1e-4 if tiny else 2e-5,
                        warmstart_steps=1500 if gpu else 300, warmstart_lr=3e-3 if tiny else 1e-3,
                        eval_prompts=512 if gpu else 128)
        for name, default in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        if self.eval_every is None:
            self.eval_every = max(1, self.steps // 5)
        _require(self.minibatches <= self.prompts_per_step * self.group_size, "minibatches", self.minibatches,
                 f"must be at most prompts x group size = {self.prompts_per_step * self.group_size}")
        # named like a --compare variant, so runs that differ write to different directories
        named_ratio = RECIPES[self.recipe][2] and self.rac_ratio != DEFAULT_RAC_RATIO
        ratio = f"@{self.rac_ratio:g}" if named_ratio else ""
        self.run_name = self.run_name or (self.recipe + ratio + (f"+tis{self.tis:g}" if self.tis else "")
                                          + ("+r3" if self.r3 else "")
                                          + (f"+mb{self.minibatches}" if self.minibatches > 1 else "")
                                          + ("+mipu" if self.mipu else ""))

    def _check_given(self):
        """Each value as given, before the defaults fill in the rest: a ConfigError naming the flag."""
        at_least_one = ("steps", "prompts_per_step", "max_new_tokens", "warmstart_batch", "eval_every",
                        "eval_prompts", "checkpoint_every", "rac_refresh", "jobs", "threads", "difficulty",
                        "minibatches")
        lows = [(name, 1) for name in at_least_one] + [("group_size", 2), ("seed", 0), ("warmstart_steps", 0)]
        for name, low in lows:
            value = getattr(self, name)
            why = " (GRPO compares the samples of one prompt)" if name == "group_size" else ""
            _require(value is None or _is_int(value) and value >= low, name, value,
                     f"must be an integer >= {low}{why}")
        for name in ("lr", "warmstart_lr", "grad_clip", "temperature"):
            value = getattr(self, name)
            _require(value is None or _is_real(value) and 0 < value < math.inf, name, value,
                     "must be a number > 0")
        bounded = (("rac_ratio", lambda v: 0 <= v <= 1, "must be in [0, 1]"),
                   ("demo_error_rate", lambda v: 0 <= v <= 1, "must be in [0, 1]"),
                   ("clip_low", lambda v: 0 <= v < 1, "must be in [0, 1)"),
                   ("clip_high", lambda v: 0 <= v < math.inf, "must be a number >= 0"),
                   ("tis", lambda v: 0 <= v < math.inf, "must be a number >= 0 (0 = off)"))
        for name, ok, allowed in bounded:
            value = getattr(self, name)
            _require(_is_real(value) and ok(value), name, value, allowed)
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            _require(value is None or value in choices, name, value, f"choose from {', '.join(choices)}")
        _refuse(self.preset and self.model, "preset", "not allowed with argument --model (it has its size)")
        _refuse(self.model and self.task == "arith", "model",
                "a real checkpoint brings its own tokenizer: add --task gsm8k")
        _refuse(not self.model and self.task != "arith", "task",
                f"{self.task} needs a real model and its tokenizer: add --model DIR")
        _refuse(self.task_source and self.task == "arith", "task-source", "applies to --task gsm8k only")
        _refuse(self.difficulty is not None and self.task != "arith", "difficulty",
                "applies to --task arith only")
        _refuse(self.model and not os.path.isdir(self.model) and not HUB_ID.fullmatch(self.model), "model",
                f"no such directory: {self.model} (give a Hugging Face Qwen3-MoE directory, or a hub id "
                "such as Qwen/Qwen3-30B-A3B)")
        _require(self.run_name == "" or os.path.basename(self.run_name) == self.run_name
                 and self.run_name not in (".", "..", "warmstart"), "run-name", self.run_name,
                 "must be a directory name under --out-dir (no '/'; 'warmstart' holds the warm-start cache)")
        _refuse(self.resume and self.overwrite, "overwrite", "not allowed with argument --resume")
        _refuse(self.mipu and self.tis, "mipu", "not allowed with argument --tis (MIPU takes its ratios "
                "against the rollout's own log-probs, so there is no engine mismatch left for TIS to "
                "correct)")
        for recipe in self.audit_recipes.split(","):  # (an empty name, as in "bf16,", is refused too)
            _require(recipe in RECIPES, "audit-recipes", recipe, f"choose from {', '.join(RECIPES)}")
        _refuse(self.audit and (self.compare or self.resume), "audit",
                "not allowed with arguments --compare or --resume (it scores a run, it does not train)")
        _refuse(self.jobs != 1 and not self.compare, "jobs", "applies to --compare only")
        _refuse(self.compare and self.run_name, "run-name",
                "not allowed with argument --compare (it names each variant's directory itself)")
        if self.compare:
            parse_compare(self.compare)


DEFAULT_RAC_RATIO = TrainConfig.rac_ratio
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # "org/name"; anything else must be a local directory


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _require(ok, name, value, allowed):
    if not ok:
        raise ConfigError(f"argument --{name.replace('_', '-')}: {allowed}, got {value!r}")


def _refuse(bad, name, why):
    if bad:
        raise ConfigError(f"argument --{name.replace('_', '-')}: {why}")


def _check_device(device):
    kind, _, index = device.partition(":")
    _require(kind in ("cpu", "cuda") and (not index or kind == "cuda" and index.isdigit()), "device", device,
             "choose from cpu, cuda, cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"argument --device: {device!r} but torch {torch.__version__} sees no CUDA GPU "
                          f"(built with CUDA {torch.version.cuda}); use --device cpu")
    if index and int(index) >= torch.cuda.device_count():
        raise ConfigError(f"argument --device: {device!r} but there are {torch.cuda.device_count()} GPUs")


def parse_variant(spec):
    """A --compare variant "recipe[@rac_ratio][+tisC][+r3]" (e.g. "quads@0.25", "nvfp4+tis2+r3") ->
    the TrainConfig fields it sets. Fields it leaves out keep the command line's values."""
    form = "the form is recipe[@rac_ratio][+tisC][+r3], e.g. bf16,nvfp4,quads@0.25+tis2"
    head, *flags = spec.split("+")
    recipe, at, ratio = head.partition("@")
    if recipe not in RECIPES:
        raise ConfigError(f"argument --compare: unknown recipe {recipe!r} in variant {spec!r}; "
                          f"choose from {', '.join(RECIPES)}" if recipe else
                          f"argument --compare: variant {spec!r} names no recipe; {form}")
    fields = {"recipe": recipe}
    try:
        if at:
            fields["rac_ratio"] = float(ratio)
        for flag in flags:
            if flag == "r3":
                fields["r3"] = True
            elif flag.startswith("tis"):
                fields["tis"] = float(flag[3:])
            else:
                raise ValueError(flag)
    except ValueError:
        raise ConfigError(f"argument --compare: cannot read variant {spec!r}; {form}") from None
    if at and not RECIPES[recipe][2]:
        raise ConfigError(f"argument --compare: variant {spec!r}: recipe {recipe} has no RAC, so no @ratio; "
                          f"RAC recipes: {', '.join(r for r in RECIPES if RECIPES[r][2])}")
    if not 0 <= fields.get("rac_ratio", 0) <= 1:
        raise ConfigError(f"argument --compare: variant {spec!r}: the RAC ratio after '@' must be in [0, 1]")
    if not 0 <= fields.get("tis", 0) < math.inf:
        raise ConfigError(f"argument --compare: variant {spec!r}: the TIS cap after 'tis' must be >= 0")
    return fields


def parse_compare(compare):
    """--compare "v1,v2,..." -> [the fields each variant sets]."""
    specs = compare.split(",")
    if not all(specs):
        raise ConfigError(f"argument --compare: empty variant in {compare!r}; give comma-separated variants, "
                          "e.g. bf16,nvfp4,quads")
    return [parse_variant(spec) for spec in specs]


# ----------------------------------------------------------------------------- building blocks
def build_task(cfg):
    """The task, loaded; a dataset that cannot be loaded is a ConfigError naming the source and the fix."""
    if cfg.task == "arith":
        return tasks.make_task("arith", difficulty=cfg.difficulty, demo_error_rate=cfg.demo_error_rate,
                               seed=cfg.seed)
    import datasets
    source = cfg.task_source or "openai/gsm8k"
    try:
        return tasks.make_task(cfg.task, source=source, seed=cfg.seed)
    except FileNotFoundError as error:
        raise ConfigError(f"argument --task-source: {error}") from None
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as error:
        cause = f"; {_one_line(error.__cause__)}" if error.__cause__ else ""
        raise ConfigError(f"argument --task-source: cannot load the {cfg.task} dataset {source!r} "
                          f"({_one_line(error)}{cause}); offline, give a local file: --task-source "
                          "FILE.jsonl (one JSON object per line with 'question' and 'answer')") from None


def _one_line(error):
    """'Type: first line of the message', for errors reported on one line."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


class HFTokenizer:
    """The four things train.py asks of a tokenizer, on a Hugging Face one: text in without special
    tokens, text out up to the first EOS, and the EOS and padding ids (EOS pads when there is no pad)."""

    def __init__(self, tokenizer):
        if tokenizer.eos_token_id is None:
            raise ConfigError("argument --model: the checkpoint's tokenizer has no EOS token, so completions "
                              "could never end")
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)

    def encode(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids):
        ids = list(ids)
        ids = ids[:ids.index(self.eos_id)] if self.eos_id in ids else ids
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def build_model(cfg, task):
    """The BF16 policy before warm-start: a preset with the task's vocabulary, or a real checkpoint."""
    torch.manual_seed(cfg.seed)
    if cfg.model:
        try:
            model, hf_tokenizer = moe.load_hf(cfg.model)
        except (OSError, ValueError) as error:  # no config.json, weights that do not fit, an unreachable hub
            where = "the directory" if os.path.isdir(cfg.model) else "no such directory, and the hub id"
            raise ConfigError(f"argument --model: cannot load {cfg.model} ({where}): "
                              f"{_one_line(error)}") from None
        if hf_tokenizer is None:
            raise ConfigError(f"argument --model: {cfg.model} has no tokenizer files (tokenizer.json, "
                              "tokenizer_config.json or vocab.json); RL needs one")
        return model.to(cfg.device), HFTokenizer(hf_tokenizer)
    config = moe.MoEConfig.from_preset(cfg.preset, vocab_size=task.tokenizer.vocab_size)
    model = moe.MoETransformer(config)
    model.init_weights()
    return model.to(cfg.device), task.tokenizer


def autocast(cfg):
    """BF16 compute with FP32 master weights on the GPU; plain FP32 on the CPU (exact, for tests)."""
    if cfg.device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def encode_prompts(tokenizer, problems):
    return [tokenizer.encode(p.prompt) for p in problems]


def max_new_tokens(cfg, task):
    return cfg.max_new_tokens or getattr(task, "max_completion_chars", 256) + 1


def load_file(path, device, what, fix):
    """torch.load, with a file that cannot be read (truncated, not torch's format) as one ConfigError."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as error:
        raise ConfigError(f"cannot read the {what} {path} ({_one_line(error)}): {fix}") from None


CHECKPOINT_KEYS = {"step", "trainer", "optimizer", "config"}


def load_checkpoint(path, device, fix):
    """load_file for a train.py checkpoint: anything else (another torch file) is one ConfigError too."""
    ckpt = load_file(path, device, "checkpoint", fix)
    if not isinstance(ckpt, dict) or not CHECKPOINT_KEYS <= set(ckpt):
        raise ConfigError(f"cannot read the checkpoint {path}: not a train.py checkpoint; {fix}")
    return ckpt


def atomic_save(obj, path, write=torch.save):
    """Write to a temporary file, then rename: a crash never leaves a half-written file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    write(obj, tmp)
    os.replace(tmp, path)


def _write_text(text, path):
    with open(path, "w") as f:
        f.write(text)


# ----------------------------------------------------------------------------- warm-start
def warmstart_path(cfg):
    """The cache file of the warm-start, keyed by everything that determines it (not by the recipe)."""
    key = json.dumps({k: getattr(cfg, k) for k in ("preset", "model", "task", "task_source", "difficulty",
                                                   "demo_error_rate", "warmstart_steps", "warmstart_batch",
                                                   "warmstart_lr", "seed", "device")}, sort_keys=True)
    return os.path.join(cfg.out_dir, "warmstart", hashlib.sha1(key.encode()).hexdigest()[:12] + ".pt")


def warmstart(cfg, model, task, tokenizer):
    """Supervised fine-tuning on demonstrations (loss on completion + EOS tokens), cached on disk."""
    path = warmstart_path(cfg)
    if os.path.exists(path):
        model.load_state_dict(load_file(path, cfg.device, "warm-start cache", "delete it to recompute it"))
        print(f"warm-start: loaded {path}")
        return model
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rng = random.Random(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warmstart_lr, weight_decay=0.0,
                                  betas=(0.9, 0.95))
    bar = tqdm(range(cfg.warmstart_steps), desc="warm-start", dynamic_ncols=True)
    for step in bar:
        warmup = min(1.0, (step + 1) / 50)
        lr = cfg.warmstart_lr * warmup * 0.5 * (1 + math.cos(math.pi * step / cfg.warmstart_steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        problems = task.sample(cfg.warmstart_batch, "train", rng)
        rows, loss_starts = [], []
        for p in problems:
            prompt = tokenizer.encode(p.prompt)
            rows.append(prompt + tokenizer.encode(task.demonstration(p, rng)) + [tokenizer.eos_id])
            loss_starts.append(len(prompt))
        width = max(map(len, rows))
        tokens = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)
        target_mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, (row, start) in enumerate(zip(rows, loss_starts)):
            tokens[i, :len(row)] = torch.tensor(row)
            target_mask[i, start:len(row)] = True
        tokens, target_mask = tokens.to(cfg.device), target_mask.to(cfg.device)
        with autocast(cfg):
            logits = model(tokens[:, :-1])
        logp = grpo.token_logprobs(logits.float(), tokens[:, 1:])                # (N, W-1)
        mask = target_mask[:, 1:]
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    atomic_save(model.state_dict(), path)
    return model


# ----------------------------------------------------------------------------- one node, every GPU (torchrun)
# SPMD and colocated: every rank holds a rollout model and a trainer, samples its share of the step's
# prompts (whole GRPO groups), scores them and computes its share of the loss. The loss of a rank is
# (sum of its tokens' losses) / (tokens of the whole batch) * world_size, so that DDP's gradient
# average is exactly the single-process gradient of the whole batch; the sampling noise follows each
# row's id in the whole batch (rollout.py), so the ranks sample exactly the rollouts one process would.
# Metrics are computed from the per-token tensors gathered from every rank: the same numbers as one
# process. Only rank 0 writes files and draws the progress bar.
@dataclass(frozen=True)
class Distributed:
    rank: int = 0
    world_size: int = 1
    enabled: bool = False          # under torchrun (a process group exists), even with one process

    @property
    def main(self):
        return self.rank == 0


SINGLE = Distributed()


def init_distributed(cfg):
    """Under torchrun (RANK and WORLD_SIZE set): join the process group (NCCL on GPUs, gloo on CPUs) and
    take this rank's GPU. Without torchrun: the single process, nothing initialized."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return SINGLE
    if not dist.is_initialized():
        cuda = cfg.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    return Distributed(dist.get_rank(), dist.get_world_size(), enabled=True)


def shard(n, ranks):
    """This rank's contiguous share [start, stop) of n items (the first n % world ranks take one more)."""
    per, extra = divmod(n, ranks.world_size)
    start = ranks.rank * per + min(ranks.rank, extra)
    return start, start + per + (ranks.rank < extra)


def gather_rows(x, ranks, fill=0):
    """Concatenate every rank's rows (N_r, T_r, ...) in rank order, padding dim 1 to the widest with `fill`.
    (Collectives want one shape on every rank: rows are padded too, and the padding dropped again.)"""
    if not ranks.enabled:
        return x
    shapes = [None] * ranks.world_size
    dist.all_gather_object(shapes, tuple(x.shape))
    rows = max(shape[0] for shape in shapes)
    padded = list(x.shape)
    padded[0] = rows
    if x.dim() > 1:
        padded[1] = max(shape[1] for shape in shapes)
    flag = x.dtype == torch.bool                                  # gloo gathers no bools: send bytes
    buffer = torch.full(padded, fill, dtype=torch.uint8 if flag else x.dtype, device=x.device)
    buffer[tuple(slice(0, n) for n in x.shape)] = x
    parts = [torch.empty_like(buffer) for _ in shapes]
    dist.all_gather(parts, buffer)
    gathered = torch.cat([part[:shape[0]] for part, shape in zip(parts, shapes)])
    return gathered.bool() if flag else gathered


def all_sum(values, ranks):
    """Element-wise sum over ranks of a float64 vector (counts, sums of rewards)."""
    values = torch.as_tensor(values, dtype=torch.float64)
    if ranks.enabled:
        values = values.to(_collective_device(ranks))
        dist.all_reduce(values)
    return values.cpu()


def _collective_device(ranks):
    return (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
            else torch.device("cpu"))


def barrier(ranks):
    if ranks.enabled:
        dist.barrier()


@contextlib.contextmanager
def rank0_first(ranks):
    """Rank 0 runs the block first, the others after it (e.g. rank 0 computes the warm-start and writes
    its cache, the others load it)."""
    if not ranks.main:
        barrier(ranks)
    yield
    if ranks.main:
        barrier(ranks)


def distribute_trainer(trainer, cfg, ranks):
    """-> the module the loop calls: DDP(trainer) (gradients averaged across ranks), or with --fsdp the
    trainer itself, sharded in place per transformer block and at the root (FSDP2's fully_shard)."""
    if not ranks.enabled:
        return trainer
    if cfg.fsdp:
        from torch.distributed.fsdp import fully_shard
        for block in trainer.layers:
            fully_shard(block)
        fully_shard(trainer)
        return trainer
    from torch.nn.parallel import DistributedDataParallel
    device_ids = [torch.cuda.current_device()] if cfg.device.startswith("cuda") else None
    return DistributedDataParallel(trainer, device_ids=device_ids)


def sharded(trainer):
    """Whether the trainer's parameters are FSDP2 shards (DTensors) rather than whole tensors."""
    return any(hasattr(p, "full_tensor") for p in trainer.parameters())


@torch.no_grad()
def sync_from_trainer(target, trainer):
    """rac.sync_weights(target, trainer), also for an FSDP2-sharded trainer: then one block at a time is
    gathered (unshard), re-quantized into the target and released (reshard), so the peak is the largest
    block, never the whole model; the root's own parameters (embeddings, final norm, LM head) last."""
    if not sharded(trainer):
        rac.sync_weights(target, trainer)
        return
    for target_block, block in zip(target.layers, trainer.layers):
        block.unshard()
        try:
            rac.sync_weights(target_block, block)
        finally:
            block.reshard()
    blocks = {f"layers.{i}." for i in range(len(trainer.layers))}
    targets = dict(target.named_parameters(remove_duplicate=False))
    for name, param in trainer.named_parameters(remove_duplicate=False):
        if not any(name.startswith(prefix) for prefix in blocks):
            targets[name].copy_(param.full_tensor())


FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


def trainer_state(trainer, optimizer):
    """Whole (unsharded) state dicts keyed by parameter name, whatever the world size or sharding, so a
    checkpoint resumes on any number of ranks. Collective under FSDP2: every rank must call it."""
    return get_model_state_dict(trainer, options=FULL_STATE), get_optimizer_state_dict(trainer, optimizer,
                                                                                        options=FULL_STATE)


def load_trainer_state(trainer, optimizer, model_state, optimizer_state):
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(trainer, model_state, options=options)
    set_optimizer_state_dict(trainer, optimizer, optimizer_state, options=options)


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(cfg, model, task, tokenizer, problems, ranks=SINGLE):
    """pass@1 by sampling one completion per held-out prompt at the training temperature (each rank
    samples its share of the prompts; row ids follow the prompt's index, so the result is the same)."""
    start, stop = shard(len(problems), ranks)
    total = 0.0
    if stop > start:
        out = rollout.generate(model, encode_prompts(tokenizer, problems[start:stop]), 1,
                               max_new_tokens(cfg, task),
                               temperature=cfg.temperature, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                               seed=cfg.seed + 12345, cuda_graph=cfg.cuda_graph, row_offset=start)
        total = score(task, tokenizer, problems[start:stop], out, 1).sum().item()
    return (all_sum([total], ranks)[0] / len(problems)).item()


def score(task, tokenizer, problems, out, group_size):
    completions = [tokenizer.decode(row[m].tolist())
                   for row, m in zip(out.completion_ids.cpu(), out.completion_mask.cpu())]
    return torch.tensor([task.reward(problems[i // group_size], text) for i, text in enumerate(completions)])


# ----------------------------------------------------------------------------- state shared by the two sides
def link_trainer_to_rollout(trainer, rollout_model, train_mode):
    """Hand a symmetric recipe's trainer what it takes from the rollout, layer by layer (the two models
    share one module tree, so a layer's path names its twin). moeresq: each trainer layer holds the
    rollout layer's RACSelector masks themselves, so every calibrate_rac refreshes both sides at once.
    trace: hooks on the rollout's quantizers feed a qat.RolloutRecorder, which is returned (else None)."""
    layers = dict(trainer.named_modules())
    if train_mode == "moeresq":
        for path, module in rollout_model.named_modules():
            if isinstance(module, rac.NVFP4Linear):
                layers[path].rac_masks = (module.rac.mask,)
            elif isinstance(module, rac.NVFP4Experts):
                layers[path].rac_masks = (module.rac_gate_up.mask, module.rac_down.mask)
    if train_mode != "trace":
        return None
    recorder = qat.RolloutRecorder()
    # a decode step is a forward with a KV cache that is not prefilling (rollout.KVCache)
    rollout_model.register_forward_pre_hook(lambda m, args, kwargs: recorder.begin_forward(
        getattr(kwargs.get("kv_cache"), "prefill_rows", 0) is None), with_kwargs=True)
    for path, module in rollout_model.named_modules():
        if isinstance(module, rac.NVFP4Linear):  # its RACSelector sees the input exactly as it is quantized
            module.rac.register_forward_pre_hook(lambda m, args, p=path: recorder.record(p, 0, args[0]))
        elif isinstance(module, rac.NVFP4Experts):
            module.register_forward_pre_hook(lambda m, args, p=path: recorder.route(p, args[1], m.n_experts))
            for index, selector in enumerate((module.rac_gate_up, module.rac_down)):  # gate/up, down inputs
                selector.register_forward_pre_hook(
                    lambda m, args, p=path, i=index: recorder.record(p, i, args[0]))
    return recorder


def hand_over_codes(recorder, trainer, out):
    """After a trace rollout: its recorded codes, keyed by the trainer's (row, column), to the trainer."""
    recorder.stop()
    width = int((out.prompt_lengths + out.completion_lengths).max())  # = out.sequences().tokens.shape[1]
    codes = recorder.codes(out.completion_mask, out.prompt_lengths, width)
    qat.use_rollout_codes(dict(trainer.named_modules()), codes)
    return codes


# ----------------------------------------------------------------------------- the policy update
def trainer_logprobs(cfg, trainer, seq, rows=slice(None)):
    """The trainer's log-probs of the sampled tokens of `rows`, tempered as the rollout sampled them:
    (n, W-1) fp32, aligned with seq.logprobs[:, 1:]; and the experts it chose, (L, n, W, A). With --r3 the
    trainer replays the rollout's expert routes."""
    tokens = seq.tokens[rows]
    with autocast(cfg):
        forced_routes = seq.routes[:, rows] if cfg.r3 else None
        logits, routes = trainer(tokens, forced_routes=forced_routes, return_routes=True)
    return grpo.token_logprobs(logits[:, :-1].float() / max(cfg.temperature, 1e-6), tokens[:, 1:]), routes


def policy_update(cfg, trainer, optimizer, seq, advantages, shuffle_seed, codes=None, ranks=SINGLE):
    """GRPO on one rollout batch: cfg.minibatches optimizer steps, each on a shuffled 1/N of its rows.

    Three log-probs per token (grpo.py): `rollout` (seq.logprobs, the engine's), `old` (the trainer under
    the weights that sampled: one forward without gradient before the first step) and `new` (the
    forward of each mini-batch, carrying the gradient). With one mini-batch, old is that one forward,
    detached: the same weights, one forward fewer, and exactly the on-policy update. The PPO ratio is
    new / old, or new / rollout with --mipu (a sampler-referenced candidate; TIS is then moot).
    The loss of each mini-batch is normalized by its own valid tokens (DAPO, as verl per mini-batch).

    Under torchrun each rank shuffles its own rows into the mini-batches, and its loss is weighted by its
    share of the mini-batch's tokens over all ranks, so that DDP's gradient average is the token mean of
    the whole mini-batch; the logged loss and ratio statistics are those of the whole mini-batch.
    codes (trace): the rollout's recorded codes, handed to the trainer's layers for the rows of each
    forward. Returns old (N, W-1), the trainer's routes under the sampling weights (L, N, W, A) and one
    dict of float statistics per mini-batch (loss, grad_norm and grpo.policy_loss's).
    """
    layers = dict(getattr(trainer, "module", trainer).named_modules()) if codes is not None else None  # DDP
    mask, rollout_logp = seq.loss_mask[:, 1:], seq.logprobs[:, 1:]
    if cfg.minibatches == 1:
        minibatches = [slice(None)]
    else:
        with torch.no_grad():
            old_logp, old_routes = trainer_logprobs(cfg, trainer, seq)
        generator = torch.Generator().manual_seed(shuffle_seed + 7919 * ranks.rank)
        rows = torch.randperm(seq.tokens.shape[0], generator=generator)
        minibatches = rows.to(seq.tokens.device).chunk(cfg.minibatches)
    minibatch_stats = []
    for rows in minibatches:
        if codes is not None and cfg.minibatches > 1:  # the codes of this mini-batch's rows
            qat.use_rollout_codes(layers, codes, rows=rows, width=seq.tokens.shape[1])
        new_logp, routes = trainer_logprobs(cfg, trainer, seq, rows)
        if cfg.minibatches == 1:
            old_logp, old_routes = new_logp.detach(), routes
        reference = rollout_logp if cfg.mipu else old_logp
        loss, stats = grpo.policy_loss(new_logp, reference[rows], advantages[rows], mask[rows], cfg.clip_low,
                                       cfg.clip_high, rollout_logprobs=rollout_logp[rows],
                                       tis_cap=cfg.tis or None)
        if all_sum([0.0 if torch.isfinite(loss) else 1.0], ranks)[0] > 0:   # on any rank: every rank stops
            raise FloatingPointError(f"non-finite loss ({loss.item()})")
        share = 1.0
        if ranks.enabled:
            tokens = mask[rows].sum().item()
            share = tokens * ranks.world_size / all_sum([tokens], ranks)[0].item()
            stats = reduce_stats({"loss": loss.detach(), **stats}, share / ranks.world_size, ranks)
            loss_logged = stats.pop("loss")
        optimizer.zero_grad(set_to_none=True)
        (loss * share).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trainer.parameters(), cfg.grad_clip)
        # FSDP2: the norm of sharded gradients is a (replicated) DTensor
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        logged = loss_logged if ranks.enabled else loss.detach()
        minibatch_stats.append({"loss": logged, "grad_norm": grad_norm.detach(), **stats})
    if codes is not None and cfg.minibatches > 1:
        qat.use_rollout_codes(layers, codes)  # every row's codes again, for a forward on the whole batch
    values = torch.stack([torch.stack([torch.as_tensor(v, dtype=torch.float32, device=grad_norm.device)
                                       for v in s.values()]) for s in minibatch_stats]).tolist()  # one sync
    return old_logp, old_routes, [dict(zip(minibatch_stats[0], row)) for row in values]


# grpo.policy_loss statistics that are extremes over the tokens (the rest are token means)
MIN_STATS, MAX_STATS = ("ratio/min",), ("ratio/max",)


def reduce_stats(stats, weight, ranks):
    """A rank's token-mean statistics -> those of all ranks' tokens (weight: this rank's share of them);
    MIN_STATS / MAX_STATS -> the extreme over ranks."""
    keys, device = list(stats), _collective_device(ranks)
    values = torch.stack([stats[key].detach().float().reshape(()) for key in keys]).to(device)
    extreme = torch.tensor([key in MIN_STATS or key in MAX_STATS for key in keys], device=device)
    sign = torch.tensor([-1.0 if key in MIN_STATS else 1.0 for key in keys], device=device)
    summed = torch.where(extreme, 0.0, values * weight)
    dist.all_reduce(summed)                                          # two collectives for all statistics:
    maxima = torch.where(extreme, values * sign, -math.inf)          # the sums, and the extremes (a minimum
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)                    # as the maximum of its negation)
    return dict(zip(keys, torch.where(extreme, maxima * sign, summed)))


def update_metrics(cfg, minibatch_stats):
    """What the log keeps of one policy update: loss and gradient norm (means over mini-batches), and,
    when they can differ from their on-policy values, the PPO ratio's mean (mean over mini-batches),
    min and max, the clipped fractions (TRL's names) and the K3 KL(old || new). With one mini-batch and
    ratios against old, ratio = 1 and no token is clipped by construction, so none of those is logged."""
    def mean(key):
        return sum(s[key] for s in minibatch_stats) / len(minibatch_stats)

    record = {"loss": mean("loss"), "grad_norm": mean("grad_norm")}
    if cfg.minibatches > 1 or cfg.mipu:
        record.update({key: mean(key) for key in ("ratio/mean", "clip_ratio/low_mean", "clip_ratio/high_mean",
                                                  "clip_ratio/region_mean", "approx_kl")})
        record["ratio/min"] = min(s["ratio/min"] for s in minibatch_stats)
        record["ratio/max"] = max(s["ratio/max"] for s in minibatch_stats)
    return record


# ----------------------------------------------------------------------------- one RL run
@dataclass
class Setup:
    """What a run is built from: models, optimizer, data and paths (everything but the loop's state)."""
    cfg: TrainConfig
    task: object
    tokenizer: object
    trainer: torch.nn.Module        # FP32 master weights, the optimizer's (forward fake-quantized per recipe)
    train_forward: torch.nn.Module  # what the loop calls: DistributedDataParallel(trainer) under torchrun,
                                    # else the trainer itself (also under --fsdp, which shards it in place)
    rollout_model: torch.nn.Module  # the recipe's rollout precision; sync() loads it from the trainer
    eval_model: torch.nn.Module     # a BF16 copy of the trainer's weights, for the trainer's own pass@1
    optimizer: torch.optim.Optimizer
    rac_ratio: float                # 0 when the recipe has no RAC
    calib_tokens: torch.Tensor      # (16, W) prompts + demonstrations that choose RAC's compensated blocks
    eval_problems: list             # held-out problems for pass@1
    run_dir: str
    ckpt_path: str
    metrics_path: str
    start_step: int                 # 0, or the checkpoint's step under --resume
    recorder: object = None         # trace: the qat.RolloutRecorder fed by hooks on the rollout's quantizers
    ranks: Distributed = SINGLE     # this process's rank and the world size (1 without torchrun)


RUN_FILES = ("metrics.jsonl", "checkpoint.pt")  # what makes a directory hold a run
# what a resumed run may change: when it stops and what it writes, not what it computes
RESUMABLE_FIELDS = {"steps", "eval_every", "checkpoint_every", "resume", "overwrite", "out_dir", "run_name",
                    "compare", "jobs", "threads", "cuda_graph", "fsdp"}


def check_run_dir(cfg):
    """Refuse, before anything is written, to start where a run would be destroyed; under --resume read
    the checkpoint and check that it continues this run. -> the checkpoint to resume from, or None."""
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    ckpt_path = os.path.join(run_dir, "checkpoint.pt")
    if not cfg.resume:
        found = [name for name in RUN_FILES if os.path.exists(os.path.join(run_dir, name))]
        if found and not cfg.overwrite:
            raise ConfigError(f"{run_dir} holds a run ({', '.join(found)}): add --resume to continue it, "
                              "--overwrite to start it over, or choose another --run-name")
        return None
    if not os.path.exists(ckpt_path):
        raise ConfigError(f"argument --resume: no checkpoint {ckpt_path} to resume (drop --resume to start "
                          "the run, or give the --out-dir and --run-name of the run to continue)")
    ckpt = load_checkpoint(ckpt_path, cfg.device, "restore it, or start the run over with --overwrite")
    changes = []
    for field in dataclasses.fields(cfg):
        stored, given = ckpt["config"].get(field.name, field.default), getattr(cfg, field.name)
        if field.name not in RESUMABLE_FIELDS and stored != given:
            changes.append(f"--{field.name.replace('_', '-')} {stored} -> {given}")
    if changes:
        raise ConfigError(f"cannot resume {run_dir}: this command changes {', '.join(changes)}; a resumed "
                          "run keeps its config (--steps may grow): give the run's values, or a new "
                          "--run-name")
    if cfg.steps < ckpt["step"]:
        raise ConfigError(f"argument --steps: {cfg.steps}, but the run in {run_dir} is at step "
                          f"{ckpt['step']}; a run cannot be shortened (give --steps >= {ckpt['step']})")
    return ckpt


def rollout_dtype(cfg):
    return torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32


def build_recipe(cfg, model, recipe, rac_ratio):
    """A recipe's two sides from one policy: the rollout model (a converted copy), the trainer (model
    itself, converted in place) and what the two share (moeresq's RAC masks; trace's recorder, returned,
    else None)."""
    train_mode, rollout_mode, _ = RECIPES[recipe]
    rollout_model = rac.convert_for_rollout(copy.deepcopy(model).to(rollout_dtype(cfg)), rollout_mode,
                                            rac_ratio=rac_ratio)
    trainer = qat.convert_for_training(model, train_mode)
    return rollout_model, trainer, link_trainer_to_rollout(trainer, rollout_model, train_mode)


def calibration_tokens(cfg, task, tokenizer):
    """(16, W) prompts + demonstrations on which RAC chooses its compensated blocks (fixed by the seed)."""
    rng = random.Random(cfg.seed + 777)
    rows = [tokenizer.encode(p.prompt + task.demonstration(p, rng)) for p in task.sample(16, "train", rng)]
    width = max(map(len, rows))
    return torch.tensor([r + [tokenizer.pad_id] * (width - len(r)) for r in rows], device=cfg.device)


def setup(cfg, base_state=None, ckpt=None, ranks=SINGLE):
    """Build a run: task, warm-started policy (or base_state), trainer, rollout and evaluation models,
    optimizer, calibration and evaluation data; restore the checkpoint under --resume. -> Setup

    Nothing is written before the run directory is checked (check_run_dir, unless its checkpoint is
    given as ckpt) and the task and model are loaded: a run that cannot start leaves the disk as it was."""
    ckpt = ckpt if ckpt is not None else check_run_dir(cfg)
    task = build_task(cfg)
    model, tokenizer = build_model(cfg, task)
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    if ranks.main:  # only rank 0 writes
        os.makedirs(run_dir, exist_ok=True)
        if cfg.overwrite:
            for name in RUN_FILES + ("curves.png",):
                if os.path.exists(os.path.join(run_dir, name)):
                    os.remove(os.path.join(run_dir, name))
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        print(f"run {cfg.run_name}: {json.dumps(dataclasses.asdict(cfg))}")
    if base_state is None:
        with rank0_first(ranks):  # rank 0 computes (or loads) the warm-start; the others load its cache
            warmstart(cfg, model, task, tokenizer)
    else:
        model.load_state_dict(base_state)  # --compare: every recipe from the one warm-start
    rac_ratio = cfg.rac_ratio if RECIPES[cfg.recipe][2] else 0.0
    # the rollout engine, the trainer, and a BF16 copy for evaluating the trainer's own weights
    eval_model = rac.convert_for_rollout(copy.deepcopy(model).to(rollout_dtype(cfg)), "bf16")
    rollout_model, trainer, recorder = build_recipe(cfg, model, cfg.recipe, rac_ratio)
    # before the optimizer: FSDP2 swaps the parameters
    train_forward = distribute_trainer(trainer, cfg, ranks)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99))
    calib_tokens = calibration_tokens(cfg, task, tokenizer)
    eval_problems = task.sample(cfg.eval_prompts, "test", random.Random(cfg.seed + 999))

    start_step = 0
    ckpt_path = os.path.join(run_dir, "checkpoint.pt")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if ckpt is not None:
        load_trainer_state(trainer, optimizer, ckpt["trainer"], ckpt["optimizer"])
        start_step = ckpt["step"]
        if ranks.main:
            _truncate_metrics(metrics_path, start_step)
            print(f"resumed {run_dir} at step {start_step}")
    s = Setup(cfg, task, tokenizer, trainer, train_forward, rollout_model, eval_model, optimizer, rac_ratio,
              calib_tokens, eval_problems, run_dir, ckpt_path, metrics_path, start_step, recorder, ranks)
    sync(s, start_step)  # the rollout starts from the trainer's weights (the checkpoint's, on resume)
    return s


def sync(s, step):
    """Trainer -> rollout weights through nvfp4 (bit-identical to what a QAT trainer used); every
    rac_refresh syncs, RAC re-chooses its compensated blocks on the calibration batch."""
    sync_from_trainer(s.rollout_model, s.trainer)
    if s.rac_ratio > 0 and step % s.cfg.rac_refresh == 0:
        rac.calibrate_rac(s.rollout_model, s.calib_tokens)


def save(s, step):
    """Rank 0 writes the whole trainer and optimizer state (gathered from the shards under FSDP2)."""
    model_state, optimizer_state = trainer_state(s.trainer, s.optimizer)
    if s.ranks.main:
        atomic_save({"step": step, "trainer": model_state, "optimizer": optimizer_state,
                     "config": dataclasses.asdict(s.cfg)}, s.ckpt_path)


def evaluate_both(s):
    """pass@1 on the held-out problems of the rollout model and of the trainer's weights in BF16."""
    sync_from_trainer(s.eval_model, s.trainer)
    return {"pass@1": evaluate(s.cfg, s.rollout_model, s.task, s.tokenizer, s.eval_problems, s.ranks),
            "pass@1_bf16_trainer": evaluate(s.cfg, s.eval_model, s.task, s.tokenizer, s.eval_problems,
                                            s.ranks)}


def run(cfg, base_state=None, ranks=SINGLE):
    """Warm-start (or reuse), then GRPO for cfg.steps; print a summary. Returns the run directory."""
    t_start = time.perf_counter()
    ckpt = check_run_dir(cfg)
    barrier(ranks)  # every rank has checked the run directory before rank 0 writes to it
    if ckpt is not None and ckpt["step"] == cfg.steps:
        run_dir = os.path.join(cfg.out_dir, cfg.run_name)
        if ranks.main:
            print(f"run {run_dir} is complete at step {cfg.steps}: nothing to do "
                  f"(--steps N > {cfg.steps} extends it)")
            print(report(cfg, run_dir))
        return run_dir
    s = setup(cfg, base_state, ckpt, ranks)
    run_dir, ckpt_path, metrics_path, start_step = s.run_dir, s.ckpt_path, s.metrics_path, s.start_step
    if start_step == 0:  # the warm-started policy, before any RL: the baseline every curve starts from
        baseline = evaluate_both(s)
        if ranks.main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps({"step": 0, **baseline}) + "\n")
    with _HeldInterrupt(start_step) as interrupt:
        try:
            _rl_steps(s, interrupt)
        except KeyboardInterrupt:
            step = interrupt.step
            if interrupt.holding:  # a second Ctrl-C inside a step's update: its weights are half-updated
                if ranks.main:
                    print(f"\ninterrupted during step {step + 1}'s update: not saved; {ckpt_path} keeps the "
                          "last checkpoint written; continue with --resume", file=sys.stderr)
            else:  # before this step's update: the weights are those of `step` finished steps
                if step > start_step:
                    save(s, step)
                if ranks.main:
                    print(f"\ninterrupted: checkpoint at step {step} in {ckpt_path}; continue with --resume",
                          file=sys.stderr)
            sys.exit(130)
    if interrupt.requested:
        if ranks.main:
            print(f"stopped: checkpoint at step {interrupt.step} in {ckpt_path}; continue with --resume",
                  file=sys.stderr)
        sys.exit(130)
    if ranks.main:
        plot([run_dir], os.path.join(run_dir, "curves.png"))
        print(report(cfg, run_dir, time.perf_counter() - t_start))
    return run_dir


def _rl_steps(s, interrupt):
    """The RL loop of `run` (see the module docstring), from s.start_step to cfg.steps; `interrupt.step` is
    the loop's step, and a Ctrl-C held during an update stops it after that step is logged and saved."""
    cfg, ranks, recorder = s.cfg, s.ranks, s.recorder
    task, tokenizer, trainer, rollout_model, optimizer = s.task, s.tokenizer, s.trainer, s.rollout_model, \
        s.optimizer
    ckpt_path, metrics_path = s.ckpt_path, s.metrics_path
    G, P = cfg.group_size, cfg.prompts_per_step
    new_tokens = max_new_tokens(cfg, task)
    bar = tqdm(range(s.start_step, cfg.steps), desc=cfg.run_name, dynamic_ncols=True, initial=s.start_step,
               total=cfg.steps, disable=not ranks.main)
    last_eval = _last_eval(metrics_path)  # the bar shows pass@1 from step 0 (or the resumed run's last)
    mipu_accepted = [r["mipu/accepted"] > 0 for r in _read_metrics(metrics_path) if "mipu/accepted" in r] \
        if cfg.mipu else []  # resumed runs count what they logged before
    for step in bar:
        interrupt.step, interrupt.holding = step, False
        t0 = time.perf_counter()
        # 1. prompts (the data order is a function of the seed and step: resumable)
        problems = task.sample(P, "train", random.Random(cfg.seed * 1_000_003 + step))
        first, last = shard(P, ranks)  # this rank's whole groups (all of them without torchrun)
        problems = problems[first:last]
        # 2. rollout in the recipe's precision (trace: recording its codes, so eagerly: hooks)
        if recorder is not None:
            recorder.start()
        out = rollout.generate(rollout_model, encode_prompts(tokenizer, problems), G, new_tokens,
                               temperature=cfg.temperature, eos_id=tokenizer.eos_id,
                               pad_id=tokenizer.pad_id, seed=cfg.seed * 1_000_003 + step,
                               row_offset=first * G,
                               cuda_graph=cfg.cuda_graph and recorder is None)
        codes = hand_over_codes(recorder, trainer, out) if recorder is not None else None
        _sync_device(cfg)
        t_rollout = time.perf_counter() - t0
        # 3. rewards and group advantages
        rewards = score(task, tokenizer, problems, out, G).to(cfg.device)
        advantages = grpo.group_advantages(rewards, G)
        seq = out.sequences()
        mask, rollout_logp = seq.loss_mask[:, 1:], seq.logprobs[:, 1:]
        if cfg.mipu:  # what a rejected candidate restores, and the rollout policy's scores before it
            before = copy.deepcopy(trainer.state_dict()), copy.deepcopy(optimizer.state_dict())
            inference_logp = rollout.score(rollout_model, seq.tokens, cfg.temperature)[:, 1:]
        # 4-5. trainer log-probs (old: the weights that sampled), loss, cfg.minibatches optimizer steps;
        # from here to the step's checkpoint a Ctrl-C is held (_HeldInterrupt)
        interrupt.holding = True
        try:
            old_logp, routes, minibatch_stats = policy_update(
                cfg, s.train_forward, optimizer, seq, advantages,
                shuffle_seed=cfg.seed * 1_000_003 + step, codes=codes, ranks=ranks)
        except FloatingPointError as error:
            raise FloatingPointError(f"{error} at step {step}: stopping. The last good checkpoint is "
                                     f"kept at {ckpt_path} (resume with --resume after changing what "
                                     f"diverged).") from None
        # metrics of the whole batch, from every rank's per-token tensors (without torchrun: this
        # process's own)
        all_mask, all_rewards = gather_rows(mask, ranks, fill=False), gather_rows(rewards, ranks)
        mismatch = grpo.mismatch_metrics(gather_rows(old_logp, ranks), gather_rows(rollout_logp, ranks),
                                         all_mask, tis_cap=cfg.tis or None)
        disagreement = float("nan")  # under --r3: the trainer routers' own top-k, which the replay overrode
        if seq.routes is not None:
            pairs = seq.loss_mask.sum().item() * routes.shape[0]          # valid (token, layer) pairs
            local = grpo.routing_disagreement(routes, seq.routes, seq.loss_mask) if pairs else 0.0
            disagreed, total_pairs = all_sum([local * pairs, pairs], ranks).tolist()
            disagreement = disagreed / total_pairs if total_pairs else float("nan")
        # 6. sync the rollout's weights through nvfp4; MIPU keeps them only if the rollout policy improved
        sync(s, step + 1)
        if cfg.mipu:
            proxy = grpo.mipu_proxy(rollout.score(rollout_model, seq.tokens, cfg.temperature)[:, 1:],
                                    inference_logp, advantages, mask)
            with torch.no_grad():  # the same estimate for the trainer's policy: what the update believes
                trainer_logp, _ = trainer_logprobs(cfg, trainer, seq)
                trainer_proxy = grpo.mipu_proxy(trainer_logp, old_logp, advantages, mask)
            if ranks.enabled:  # the whole batch's token means, so that every rank takes one decision
                tokens = mask.sum().item()
                proxy, trainer_proxy, total = all_sum([proxy * tokens, trainer_proxy * tokens, tokens],
                                                      ranks).tolist()
                proxy, trainer_proxy = proxy / max(total, 1), trainer_proxy / max(total, 1)
            if proxy <= 0:
                trainer.load_state_dict(before[0])
                optimizer.load_state_dict(before[1])
                sync(s, step + 1)
            mipu_accepted.append(proxy > 0)
        if recorder is not None:
            qat.use_rollout_codes(dict(trainer.named_modules()), None)  # free the recorded codes
        # 7. log, evaluate, checkpoint
        n_tokens, n_rows = all_sum([out.completion_mask.sum().item(), out.completion_mask.shape[0]],
                                   ranks).tolist()
        record = {"step": step + 1, "reward": all_rewards.mean().item(),
                  **update_metrics(cfg, minibatch_stats),
                  "completion_len": n_tokens / n_rows,
                  "routing_disagreement": disagreement, "rollout_s": t_rollout,
                  "rollout_tokens_per_s": n_tokens / t_rollout,
                  **{f"mismatch/{k}": v for k, v in mismatch.items()}}
        if cfg.mipu:
            record.update({"mipu/proxy": proxy, "mipu/trainer_proxy": trainer_proxy,
                           "mipu/accepted": float(proxy > 0),
                           "mipu/accept_rate": sum(mipu_accepted) / len(mipu_accepted)})
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            last_eval = evaluate_both(s)
            record.update(last_eval)
        record["step_s"] = time.perf_counter() - t0
        if ranks.main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        bar.set_postfix(reward=f"{record['reward']:.2f}",
                        pass1=f"{last_eval.get('pass@1', float('nan')):.2f}",
                        dlogp=f"{mismatch['abs_diff_mean']:.1e}", max=f"{mismatch['abs_diff_max']:.2f}")
        stop = interrupt.requested
        if ranks.enabled:  # every rank stops after the same step
            stop = all_sum([float(stop)], ranks)[0].item() > 0
        if stop or (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            save(s, step + 1)
        interrupt.step, interrupt.holding = step + 1, False
        if stop:
            interrupt.requested = True
            return


class _HeldInterrupt:
    """Ctrl-C while a step changes the trainer's weights (from its first optimizer step to its metrics line
    and checkpoint) is held until that step ends, so that what is saved is always a finished, logged step;
    elsewhere, and on a second Ctrl-C, it acts at once. Only in the main thread (signals live there)."""

    def __init__(self, step):
        self.step = step  # the RL loop's step: finished steps, or the one whose update is running
        self.holding = self.requested = False
        self.previous = None

    def __enter__(self):
        try:
            self.previous = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread: Ctrl-C keeps its default meaning
            self.previous = None
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def _handler(self, signum, frame):
        if self.holding and not self.requested:
            self.requested = True
            print("\nCtrl-C: finishing this step's update, then saving (Ctrl-C again: stop now, unsaved)",
                  file=sys.stderr, flush=True)
            return
        raise KeyboardInterrupt


def report(cfg, run_dir, seconds=None):
    """The end-of-run summary: final pass@1, mismatch over the run, wall time, where everything is."""
    records = _read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    steps = [r for r in records if r["step"] > 0]
    evals = [r for r in records if "pass@1" in r]
    lines = [f"{cfg.run_name}: {steps[-1]['step'] if steps else 0} steps"
             + (f" in {seconds:.0f} s" if seconds is not None else "")]
    if evals:
        first, last = evals[0], evals[-1]
        lines.append(f"  pass@1        rollout {last['pass@1']:.3f}, BF16 trainer "
                     f"{last['pass@1_bf16_trainer']:.3f} at step {last['step']} "
                     f"(step {first['step']}: {first['pass@1']:.3f}, {first['pass@1_bf16_trainer']:.3f})")
    if steps:
        mean = sum(r["mismatch/abs_diff_mean"] for r in steps) / len(steps)
        worst = max(r["mismatch/abs_diff_max"] for r in steps)
        lines.append(f"  |delta logp|  mean {mean:.2e}, max {worst:.3f} over steps 1-{steps[-1]['step']}")
    for name, file in (("metrics", "metrics.jsonl"), ("checkpoint", "checkpoint.pt"),
                       ("figure", "curves.png")):
        lines.append(f"  {name:<13} {os.path.join(run_dir, file)}")
    lines.append(f"  {'warm-start':<13} {warmstart_path(cfg)}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the log-prob audit
AUDIT_STATS = [("signed mean", "diff_mean"), ("MAE", "abs_diff_mean"), ("p95", "abs_diff_p95"),
               ("p99", "abs_diff_p99"), ("max", "abs_diff_max")]


def audit(cfg):
    """--audit PATH: one rollout batch per recipe, its tokens scored three ways, from a run's weights.

        A  the log-probs the rollout engine recorded while it generated the batch (decode, one token a step)
        B  the same rollout model re-scoring the same tokens in one prefill (rollout.score), done twice
        C  the recipe's trainer forward on the same tokens (what the loss sees as `old`)

    A - B isolates the engine's own nondeterminism (decode vs prefill numerics; the dynamic per-tensor
    activation scale that makes a token's rounding depend on the rest of its GEMM); B - C is precision
    (the rollout's quantized layers against the trainer's); B - B' must be 0 (a repeatable prefill). For
    each, over the completion tokens: signed mean, mean absolute error, p95, p99 and max of |d|.

    PATH is a run directory (its checkpoint.pt) or a checkpoint file; the run's own config (preset, task,
    batch shape, temperature, RAC ratio, seed) is used, with this command's device and audit_recipes.
    Every recipe starts from the checkpoint's weights and scores a batch it sampled itself (same prompts
    and seed). Writes audit.md and audit.json beside the checkpoint, and each batch (tokens, A, B, C) as
    audit_batch_<recipe>.pt; returns the path of audit.md.
    """
    ckpt_path = cfg.audit if os.path.isfile(cfg.audit) else os.path.join(cfg.audit, "checkpoint.pt")
    if not os.path.isfile(ckpt_path):
        raise ConfigError(f"argument --audit: no checkpoint at {cfg.audit!r}; give a run directory holding "
                          f"checkpoint.pt or a checkpoint file")
    ckpt = load_checkpoint(ckpt_path, "cpu", "give another run directory or checkpoint")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    skipped = ("device", "run_name", "compare", "jobs", "resume", "overwrite", "threads", "audit",
               "audit_recipes", "mipu", "tis")
    run_cfg = TrainConfig(**{k: v for k, v in ckpt["config"].items() if k in known and k not in skipped},
                          device=cfg.device)
    task = build_task(run_cfg)
    model, tokenizer = build_model(run_cfg, task)
    model.load_state_dict(ckpt["trainer"])  # QAT layers keep moe.py's parameter names
    problems = task.sample(run_cfg.prompts_per_step, "train", random.Random(run_cfg.seed + 4242))
    calib_tokens = calibration_tokens(run_cfg, task, tokenizer)  # the run's RAC calibration batch
    out_dir = os.path.dirname(os.path.abspath(ckpt_path))

    results = {}
    for recipe in cfg.audit_recipes.split(","):
        rac_ratio = run_cfg.rac_ratio if RECIPES[recipe][2] else 0.0
        rollout_model, trainer, recorder = build_recipe(run_cfg, copy.deepcopy(model), recipe, rac_ratio)
        if rac_ratio > 0:
            rac.calibrate_rac(rollout_model, calib_tokens)
        if recorder is not None:
            recorder.start()
        out = rollout.generate(rollout_model, encode_prompts(tokenizer, problems), run_cfg.group_size,
                               max_new_tokens(run_cfg, task), temperature=run_cfg.temperature,
                               eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, seed=run_cfg.seed + 4242,
                               cuda_graph=cfg.cuda_graph and recorder is None)
        if recorder is not None:
            hand_over_codes(recorder, trainer, out)
        seq = out.sequences()
        mask = seq.loss_mask[:, 1:]
        recorded = seq.logprobs[:, 1:]                                                    # A
        rescored, replayed = (rollout.score(rollout_model, seq.tokens, run_cfg.temperature)[:, 1:]
                              for _ in range(2))                                          # B, B'
        with torch.no_grad():
            trainer_logp, _ = trainer_logprobs(run_cfg, trainer, seq)                     # C
        results[recipe] = {
            "tokens": int(mask.sum()),
            "A-B": grpo.mismatch_metrics(recorded, rescored, mask),
            "B-C": grpo.mismatch_metrics(rescored, trainer_logp, mask),
            "B-B replay max": (rescored - replayed)[mask].abs().max().item(),
        }
        atomic_save({"tokens": seq.tokens.cpu(), "loss_mask": seq.loss_mask.cpu(), "A": recorded.cpu(),
                     "B": rescored.cpu(), "C": trainer_logp.cpu()},
                    os.path.join(out_dir, f"audit_batch_{recipe}.pt"))
        del rollout_model, trainer

    header = (f"Log-prob audit of {ckpt_path} (RL step {ckpt['step']}): {run_cfg.prompts_per_step} prompts "
              f"x {run_cfg.group_size} samples per recipe, preset {run_cfg.preset or run_cfg.model}, "
              f"temperature {run_cfg.temperature:g}, {cfg.device}, torch {torch.__version__}. d in nats over "
              f"completion tokens; A recorded at decode, B one-prefill re-score, C trainer forward.")
    columns = ["recipe", "tokens"] + [f"A-B {name}" for name, _ in AUDIT_STATS] + \
              [f"B-C {name}" for name, _ in AUDIT_STATS] + ["B replay max"]
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for recipe, r in results.items():
        cells = [recipe, str(r["tokens"])] + [f"{r[pair][key]:.2e}" for pair in ("A-B", "B-C")
                                              for _, key in AUDIT_STATS]
        lines.append("| " + " | ".join(cells + [f"{r['B-B replay max']:.1e}"]) + " |")
    table = "\n".join(lines) + "\n"
    md_path = os.path.join(out_dir, "audit.md")
    atomic_save(table, md_path, _write_text)
    atomic_save(json.dumps({"checkpoint": ckpt_path, "step": ckpt["step"], "device": cfg.device,
                            "torch": torch.__version__, "config": dataclasses.asdict(run_cfg),
                            "recipes": results}, indent=2), os.path.join(out_dir, "audit.json"), _write_text)
    print(table)
    return md_path


def _sync_device(cfg):
    if cfg.device.startswith("cuda"):
        torch.cuda.synchronize()


def _read_metrics(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _truncate_metrics(path, step):
    """On resume, drop records logged after the checkpoint (they will be recomputed identically)."""
    kept = [r for r in _read_metrics(path) if r["step"] <= step]
    atomic_save("".join(json.dumps(r) + "\n" for r in kept), path, _write_text)


def _last_eval(path):
    evals = [r for r in _read_metrics(path) if "pass@1" in r]
    return {k: evals[-1][k] for k in ("pass@1", "pass@1_bf16_trainer")} if evals else {}


# ----------------------------------------------------------------------------- figures
def smooth(values, window):
    """Trailing mean over the last `window` values (fewer at the start): per-step RL metrics are noisy."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(run_dirs, path, window=10):
    """Reward, pass@1 and mismatch (mean and max |delta logp|, routing disagreement) over steps; every
    per-step curve is a trailing `window`-step mean (pass@1 evaluations are plotted as they are)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("reward", "reward (train batch)"), ("pass@1", "pass@1 (rollout model, held-out)"),
              ("mismatch/abs_diff_mean", "mean |delta logp|"), ("mismatch/abs_diff_max", "max |delta logp|"),
              ("mismatch/kl_k3", "K3 KL(rollout || trainer)"),
              ("routing_disagreement", "routing disagreement")]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for run_dir in run_dirs:
        records = _read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        label = os.path.basename(os.path.normpath(run_dir))
        for ax, (key, title) in zip(axes.flat, panels):
            points = [(r["step"], r[key]) for r in records
                      if key in r and r[key] is not None and not math.isnan(r[key])]
            if points and key != "pass@1":
                steps, values = zip(*points)
                points = list(zip(steps, smooth(values, window)))
            if points:
                ax.plot(*zip(*points), label=label, marker="o" if key == "pass@1" else None, markersize=3)
            smoothed = "" if key == "pass@1" or window == 1 else f", {window}-step mean"
            ax.set_title(title + smoothed, fontsize=10)
            ax.set_xlabel("RL step", fontsize=8)
            if "mismatch" in key:
                ax.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    print(f"figure: {path}")


def summarize(run_dirs, checkpoints=(50, 100)):
    """A markdown table of the runs: final pass@1 (rollout model, BF16 trainer), mean and max |delta
    logp| and routing disagreement averaged over the 10 steps up to each checkpoint step and the end,
    mean rollout tokens/s and step time."""
    header = ["run", "pass@1 rollout / bf16 trainer"]
    rows = []
    for run_dir in run_dirs:
        records = _read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        steps = [r for r in records if r["step"] > 0]
        evals = [r for r in records if "pass@1" in r]
        if not steps or not evals:
            continue
        marks = [c for c in checkpoints if c < steps[-1]["step"]] + [steps[-1]["step"]]
        header = ["run", "pass@1 rollout / bf16 trainer"] + [
            f"{name} @ {', '.join(map(str, marks))}"
            for name in ("mean abs dlogp", "max abs dlogp", "routing disagr.")]
        header += ["rollout tok/s", "step s"]

        def window(key, end):
            values = [r[key] for r in steps if end - 10 < r["step"] <= end and not math.isnan(r[key])]
            return sum(values) / len(values) if values else float("nan")

        rows.append([os.path.basename(os.path.normpath(run_dir)),
                     f"{evals[-1]['pass@1']:.3f} / {evals[-1]['pass@1_bf16_trainer']:.3f}"]
                    + [", ".join(f"{window(key, m):{fmt}}" for m in marks)
                       for key, fmt in (("mismatch/abs_diff_mean", ".2e"), ("mismatch/abs_diff_max", ".3f"),
                                        ("routing_disagreement", ".2%"))]
                    + [f"{sum(r['rollout_tokens_per_s'] for r in steps) / len(steps):,.0f}",
                       f"{sum(r['step_s'] for r in steps) / len(steps):.2f}"])
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's "prog: error: ..." and exit 2, without the 40-option usage
        self.exit(2, f"{self.prog}: error: {message}\n")


def _option_docs():
    """TrainConfig's source -> {field: (group, help)}: a field's trailing comment is its help, a comment
    line of its own opens a group. The dataclass stays the one place where an option is documented."""
    docs, group = {}, "options"
    for line in inspect.getsource(TrainConfig).splitlines()[1:]:
        if line.startswith("    def "):
            break
        title = re.fullmatch(r"    # (.+)", line)
        field = re.fullmatch(r"    (\w+): [^#]*?(?:#\s*(.*))?", line)
        more = re.fullmatch(r"     +# (.+)", line)  # a help text continued on the next line
        if title:
            group = title.group(1)
        elif field:
            name = field.group(1)
            docs[name] = (group, field.group(2) or "")
        elif more:
            docs[name] = (group, f"{docs[name][1]} {more.group(1)}")
    return docs


def build_parser():
    """The CLI, built from TrainConfig: one option per field, grouped and documented as the fields are."""
    parser = _Parser(prog="train.py", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     usage="python train.py [--recipe R | --compare V1,V2,...] [options] (see --help)")
    docs, groups, hints = _option_docs(), {}, typing.get_type_hints(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        group_name, text = docs.get(field.name, ("options", ""))
        if group_name not in groups:
            groups[group_name] = parser.add_argument_group(group_name)
        default = field.default
        if field.name in CHOICES:
            text += f" {{{', '.join(CHOICES[field.name])}}}"
        if default is not None and default != "":
            text += f" (default: {default})"
        kind = hints[field.name]
        kind = next((t for t in typing.get_args(kind) if t is not type(None)), kind)  # int | None -> int
        flag = "--" + field.name.replace("_", "-")
        if kind is bool:
            groups[group_name].add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                            help=text.replace("%", "%%"))
        else:
            groups[group_name].add_argument(flag, type=kind, default=default, help=text.replace("%", "%%"),
                                            metavar={int: "N", float: "X"}.get(kind, "STR"))
    return parser


def parse_args(argv=None):
    """Command line -> TrainConfig (a bad value raises ConfigError, as TrainConfig does)."""
    return TrainConfig(**vars(build_parser().parse_args(argv)))


def compare_paths(cfg, run_names):
    """--compare's figure and table, named by the variants (so that another comparison keeps its own)."""
    stem = "compare_" + "_".join(run_names)
    if len(stem) > 100:  # file names have a length limit
        digest = hashlib.sha1(",".join(run_names).encode()).hexdigest()[:10]
        stem = f"compare_{len(run_names)}variants_{digest}"
    return os.path.join(cfg.out_dir, stem + ".png"), os.path.join(cfg.out_dir, stem + ".md")


def study(cfg):
    """--compare: every variant from one warm-start (computed once) and seed; shared figure and table."""
    variants = [dataclasses.replace(cfg, run_name="", compare="", jobs=1, **fields)
                for fields in parse_compare(cfg.compare)]
    names = [variant.run_name for variant in variants]
    repeated = next((name for name in names if names.count(name) > 1), None)
    if repeated:
        raise ConfigError(f"argument --compare: {cfg.compare!r} names the run {repeated!r} twice")
    outputs = compare_paths(cfg, names)
    for variant in variants:  # refuse before the warm-start writes anything
        check_run_dir(variant)
    existing = [path for path in outputs if os.path.exists(path)]
    if existing and not (cfg.resume or cfg.overwrite):
        raise ConfigError(f"{existing[0]} exists: add --overwrite to replace it (or --resume to continue "
                          "the runs)")
    task = build_task(variants[0])
    model, tokenizer = build_model(variants[0], task)
    base_state = copy.deepcopy(warmstart(variants[0], model, task, tokenizer).state_dict())
    if cfg.jobs == 1:
        run_dirs = [run(variant, base_state) for variant in variants]
    else:
        # Each process loads the warm-start from its cache, written above. Timings (rollout tok/s, step s)
        # are then measured on a shared device: compare them only between runs made with the same --jobs.
        del model, base_state
        threads = max(1, torch.get_num_threads() // cfg.jobs)  # CPU: split the cores between processes
        with multiprocessing.get_context("spawn").Pool(cfg.jobs, torch.set_num_threads, (threads,)) as pool:
            run_dirs = pool.map(run, variants, chunksize=1)
    figure, table_path = outputs
    plot(run_dirs, figure)
    table = summarize(run_dirs)
    with open(table_path, "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"table: {table_path}")
    return run_dirs


def set_threads(cfg):
    """CPU: torch's threads (--threads, or 1 on the tiny preset). The tiny model's matmuls are too small
    to gain from a second thread, and two threads that synchronize at every op stall whenever another
    process holds one of the cores: on a shared 2-core machine the default run is several times slower."""
    threads = cfg.threads or (1 if cfg.preset == "tiny" else None)
    if cfg.device == "cpu" and threads:
        torch.set_num_threads(threads)


def main(argv=None):
    """The command line: one run, or a --compare study. A ConfigError exits 2 with its one line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = TrainConfig(**vars(args))
        set_threads(cfg)  # here, not in run(): a program that imports train.py keeps its own setting
        if cfg.audit:
            return audit(cfg)
        ranks = init_distributed(cfg)
        if ranks.enabled or cfg.fsdp:
            return [run_distributed(cfg, ranks)]
        return study(cfg) if cfg.compare else [run(cfg)]
    except ConfigError as error:
        parser.error(str(error))


def run_distributed(cfg, ranks):
    """One run under torchrun: every rank runs the same loop on its share of each step's groups."""
    _refuse(not ranks.enabled, "fsdp", "shards the trainer across torchrun ranks: run it as "
            "torchrun --nproc_per_node=N train.py --fsdp ...")
    _refuse(cfg.compare, "compare", "not allowed under torchrun (it runs processes of its own)")
    _refuse(cfg.mipu and cfg.fsdp, "mipu", "not allowed with argument --fsdp (a rejected update restores "
            "whole state dicts)")
    rows = cfg.prompts_per_step // ranks.world_size * cfg.group_size
    _require(rows >= cfg.minibatches, "prompts-per-step", cfg.prompts_per_step,
             f"must give each of the {ranks.world_size} ranks at least --minibatches {cfg.minibatches} rows "
             f"({cfg.group_size} per prompt)")
    try:
        result = run(cfg, ranks=ranks)
        dist.barrier()  # every rank done with its collectives before the group goes (gloo aborts otherwise)
        return result
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
