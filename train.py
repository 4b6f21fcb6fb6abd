"""GRPO with NVFP4 rollouts and BF16 training, and the two-sided fix that keeps them aligned.

    python train.py                                   # the default experiment (quads recipe)
    python train.py --recipe nvfp4 --steps 300        # the naive recipe
    python train.py --compare bf16,nvfp4,quads        # the paper's experiment, shared figures
    python train.py --compare rac@0,rac@0.25,rac@0.5,nvfp4+tis2,quads+r3   # variants: RAC ratio, TIS, R3
    python train.py --compare bf16,fp8,nvfp4,quads --jobs 4                # four processes sharing one GPU
    python train.py --model path/to/qwen3-moe --task gsm8k --recipe quads

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
    (--mipu: keep the update only if the synced rollout policy improved; recalibrate RAC, evaluate, log)

Recipes (DESIGN.md): what the trainer's forward computes and what precision the rollout runs in.

    recipe   trainer forward                 rollout linear layers
    bf16     BF16                            BF16
    fp8      BF16                            FP8 W8A8
    nvfp4    BF16                            NVFP4 W4A4                (naive)
    qat      NVFP4 weights (fake-quantized)  NVFP4 W4A4                (trainer side alone)
    rac      BF16                            NVFP4 W4A4 + RAC          (rollout side alone)
    quads    as qat                          as rac                    (both sides: the stable recipe)
    w4a4     NVFP4 weights and activations   NVFP4 W4A4                (the symmetric alternative)

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

Warm-start: a short supervised run on the task's (deliberately imperfect) demonstrations, cached under
out_dir/warmstart/ by everything that determines it, so every recipe and every later run with the same
settings starts from the same weights. Checkpoints are written atomically every `checkpoint_every`
steps and on Ctrl-C; `--resume` continues with the same data order and sampling seeds (both are a
function of the step), and a NaN/Inf loss stops the run, keeping the last good checkpoint.

Device defaults: on a CPU the tiny preset and a short run (a few minutes on 2 cores); on a GPU the
small preset and the full experiment. Every field below can be set from the command line.
"""
import argparse
import copy
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import random
import sys
import time
from dataclasses import dataclass

import torch
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
}


@dataclass
class TrainConfig:
    # what to run
    recipe: str = "quads"          # one of RECIPES
    compare: str = ""              # comma-separated variants "recipe[@rac_ratio][+tisC][+r3]": one warm-start and seed, shared figures
    jobs: int = 1                  # --compare: variants run at once, one process each (a small model leaves a GPU mostly idle)
    tis: float = 0.0               # truncated importance sampling cap C (0 = off; verl uses 2)
    r3: bool = False               # replay the rollout's expert routes in the trainer (R3)
    rac_ratio: float = 0.5         # fraction of activation blocks compensated by RAC (rac, quads recipes)
    rac_refresh: int = 1           # recalibrate the RAC block selection every N weight syncs
    # model and task
    preset: str = ""               # moe.PRESETS name; "" = "tiny" on CPU, "small" on GPU
    model: str = ""                # Hugging Face Qwen3-MoE directory or hub id (instead of a preset)
    task: str = "arith"            # "arith" (built-in) or "gsm8k"
    task_source: str = ""          # gsm8k: a hub dataset name or a local .jsonl/.json/.parquet ("" = openai/gsm8k)
    difficulty: int = 0            # digits per operand of the arith task; 0 = 2 on CPU, 3 on GPU
    demo_error_rate: float = 0.5   # share of warm-start demonstrations with one mistake
    # RL
    steps: int = 0                 # RL steps; 0 = 60 on CPU, 200 on GPU
    prompts_per_step: int = 0      # P; 0 = 16 on CPU, 32 on GPU
    group_size: int = 8            # G samples per prompt
    lr: float = 0.0                # 0 = 1e-4 on the tiny preset, 2e-5 otherwise
    temperature: float = 1.0
    max_new_tokens: int = 0        # 0 = the task's longest completion + 1 (EOS)
    clip_low: float = 0.2
    clip_high: float = 0.28
    grad_clip: float = 1.0
    minibatches: int = 1           # optimizer steps per rollout batch, each on a shuffled 1/N of its rows
    mipu: bool = False             # MIPU: ratios vs the rollout; keep an update only if the rollout improves
    # warm-start (supervised, on demonstrations)
    warmstart_steps: int = 0       # 0 = 300 on CPU, 1500 on GPU
    warmstart_batch: int = 64
    warmstart_lr: float = 0.0      # 0 = 3e-3 on the tiny preset, 1e-3 otherwise
    # evaluation, logging, safety
    eval_every: int = 0            # 0 = steps // 5
    eval_prompts: int = 0          # held-out prompts for pass@1; 0 = 128 on CPU, 512 on GPU
    checkpoint_every: int = 25
    out_dir: str = "runs"
    run_name: str = ""             # default: the recipe (plus +tis/+r3)
    resume: bool = False
    seed: int = 0
    device: str = ""               # "" = cuda if available, else cpu
    cuda_graph: bool = True        # decode steps as a captured CUDA graph (GPU only)
    # the log-prob audit (instead of training)
    audit: str = ""                # a run directory or checkpoint: score one batch three ways per recipe
    audit_recipes: str = "bf16,nvfp4,quads"  # --audit: the recipes whose rollout and trainer score the batch

    def __post_init__(self):
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        gpu = self.device.startswith("cuda")
        self.preset = self.preset or ("" if self.model else ("small" if gpu else "tiny"))
        self.difficulty = self.difficulty or (3 if gpu else 2)
        self.steps = self.steps or (200 if gpu else 60)
        self.prompts_per_step = self.prompts_per_step or (32 if gpu else 16)
        tiny = self.preset == "tiny"
        self.lr = self.lr or (1e-4 if tiny else 2e-5)
        self.warmstart_steps = self.warmstart_steps or (1500 if gpu else 300)
        self.warmstart_lr = self.warmstart_lr or (3e-3 if tiny else 1e-3)
        self.eval_every = self.eval_every or max(1, self.steps // 5)
        self.eval_prompts = self.eval_prompts or (512 if gpu else 128)
        if self.recipe not in RECIPES:
            raise ValueError(f"--recipe must be one of {sorted(RECIPES)}, got {self.recipe!r}")
        for spec in filter(None, self.compare.split(",")):
            parse_variant(spec)  # raises on a malformed variant or an unknown recipe
        if not 0.0 <= self.rac_ratio <= 1.0:
            raise ValueError(f"--rac-ratio must be in [0, 1], got {self.rac_ratio}")
        if self.tis < 0:
            raise ValueError(f"--tis must be >= 0 (0 = off), got {self.tis}")
        if self.model and self.task == "arith":
            raise ValueError("--model loads a real checkpoint with its own tokenizer: use --task gsm8k")
        if self.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {self.jobs}")
        if self.group_size < 2:
            raise ValueError(f"--group-size must be >= 2 (GRPO compares samples of one prompt), got {self.group_size}")
        if not 1 <= self.minibatches <= self.prompts_per_step * self.group_size:
            raise ValueError(f"--minibatches must be in [1, prompts x group size = "
                             f"{self.prompts_per_step * self.group_size}], got {self.minibatches}")
        if self.mipu and self.tis:
            raise ValueError("--mipu takes its ratios against the rollout's own log-probs, so --tis has "
                             "nothing left to correct: use one or the other")
        for recipe in filter(None, self.audit_recipes.split(",")):
            if recipe not in RECIPES:
                raise ValueError(f"--audit-recipes: unknown recipe {recipe!r}; choose from {sorted(RECIPES)}")
        # named like a --compare variant, so runs that differ write to different directories
        ratio = f"@{self.rac_ratio:g}" if RECIPES[self.recipe][2] and self.rac_ratio != DEFAULT_RAC_RATIO else ""
        self.run_name = self.run_name or (self.recipe + ratio + (f"+tis{self.tis:g}" if self.tis else "")
                                          + ("+r3" if self.r3 else "")
                                          + (f"+mb{self.minibatches}" if self.minibatches > 1 else "")
                                          + ("+mipu" if self.mipu else ""))


DEFAULT_RAC_RATIO = TrainConfig.rac_ratio


def parse_variant(spec):
    """A --compare variant "recipe[@rac_ratio][+tisC][+r3]" (e.g. "quads@0.25", "nvfp4+tis2+r3") ->
    the TrainConfig fields it sets. Fields it leaves out keep the command line's values."""
    head, *flags = spec.split("+")
    recipe, _, ratio = head.partition("@")
    if recipe not in RECIPES:
        raise ValueError(f"--compare: unknown recipe {recipe!r} in {spec!r}; choose from {sorted(RECIPES)}")
    fields = {"recipe": recipe}
    try:
        if ratio:
            fields["rac_ratio"] = float(ratio)
        for flag in flags:
            if flag == "r3":
                fields["r3"] = True
            elif flag.startswith("tis"):
                fields["tis"] = float(flag[3:])
            else:
                raise ValueError(flag)
    except ValueError:
        raise ValueError(f"--compare: cannot read variant {spec!r}; the form is recipe[@rac_ratio][+tisC][+r3]") from None
    return fields


# ----------------------------------------------------------------------------- building blocks
def build_task(cfg):
    if cfg.task == "arith":
        return tasks.make_task("arith", difficulty=cfg.difficulty, demo_error_rate=cfg.demo_error_rate, seed=cfg.seed)
    return tasks.make_task(cfg.task, **({"source": cfg.task_source} if cfg.task_source else {}), seed=cfg.seed)


class HFTokenizer:
    """The four things train.py asks of a tokenizer, on a Hugging Face one: text in without special
    tokens, text out up to the first EOS, and the EOS and padding ids (EOS pads when there is no pad)."""

    def __init__(self, tokenizer):
        if tokenizer.eos_token_id is None:
            raise ValueError("the checkpoint's tokenizer has no EOS token: completions could never end")
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
        model, hf_tokenizer = moe.load_hf(cfg.model)
        if hf_tokenizer is None:
            raise ValueError(f"--model {cfg.model}: the checkpoint has no tokenizer files; RL needs one")
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


def atomic_save(obj, path):
    """torch.save to a temporary file, then rename: a crash never leaves a half-written file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- warm-start
def warmstart(cfg, model, task, tokenizer):
    """Supervised fine-tuning on demonstrations (loss on completion + EOS tokens), cached on disk."""
    key = json.dumps({k: getattr(cfg, k) for k in ("preset", "model", "task", "task_source", "difficulty",
                                                   "demo_error_rate", "warmstart_steps", "warmstart_batch",
                                                   "warmstart_lr", "seed", "device")}, sort_keys=True)
    path = os.path.join(cfg.out_dir, "warmstart", hashlib.sha1(key.encode()).hexdigest()[:12] + ".pt")
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, map_location=cfg.device, weights_only=True))
        print(f"warm-start: loaded {path}")
        return model
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rng = random.Random(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warmstart_lr, weight_decay=0.0, betas=(0.9, 0.95))
    bar = tqdm(range(cfg.warmstart_steps), desc="warm-start", dynamic_ncols=True)
    for step in bar:
        lr = cfg.warmstart_lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / cfg.warmstart_steps))
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


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(cfg, model, task, tokenizer, problems):
    """pass@1 by sampling one completion per held-out prompt at the training temperature."""
    out = rollout.generate(model, encode_prompts(tokenizer, problems), 1, max_new_tokens(cfg, task),
                           temperature=cfg.temperature, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                           seed=cfg.seed + 12345, cuda_graph=cfg.cuda_graph)
    rewards = score(task, tokenizer, problems, out, 1)
    return rewards.mean().item()


def score(task, tokenizer, problems, out, group_size):
    completions = [tokenizer.decode(row[m].tolist()) for row, m in zip(out.completion_ids.cpu(), out.completion_mask.cpu())]
    return torch.tensor([task.reward(problems[i // group_size], text) for i, text in enumerate(completions)])


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


def policy_update(cfg, trainer, optimizer, seq, advantages, shuffle_seed):
    """GRPO on one rollout batch: cfg.minibatches optimizer steps, each on a shuffled 1/N of its rows.

    Three log-probs per token (grpo.py): `rollout` (seq.logprobs, the engine's), `old` (the trainer under
    the weights that sampled: one forward without gradient before the first step) and `new` (the
    forward of each mini-batch, carrying the gradient). With one mini-batch, old is that one forward,
    detached: the same weights, one forward fewer, and exactly the on-policy update. The PPO ratio is
    new / old, or new / rollout with --mipu (a sampler-referenced candidate; TIS is then moot).
    The loss of each mini-batch is normalized by its own valid tokens (DAPO, as verl per mini-batch).

    Returns old (N, W-1), the trainer's routes under the sampling weights (L, N, W, A) and one dict of
    float statistics per mini-batch (loss, grad_norm and grpo.policy_loss's).
    """
    mask, rollout_logp = seq.loss_mask[:, 1:], seq.logprobs[:, 1:]
    if cfg.minibatches == 1:
        minibatches = [slice(None)]
    else:
        with torch.no_grad():
            old_logp, old_routes = trainer_logprobs(cfg, trainer, seq)
        rows = torch.randperm(seq.tokens.shape[0], generator=torch.Generator().manual_seed(shuffle_seed))
        minibatches = rows.to(seq.tokens.device).chunk(cfg.minibatches)
    minibatch_stats = []
    for rows in minibatches:
        new_logp, routes = trainer_logprobs(cfg, trainer, seq, rows)
        if cfg.minibatches == 1:
            old_logp, old_routes = new_logp.detach(), routes
        reference = rollout_logp if cfg.mipu else old_logp
        loss, stats = grpo.policy_loss(new_logp, reference[rows], advantages[rows], mask[rows], cfg.clip_low,
                                       cfg.clip_high, rollout_logprobs=rollout_logp[rows],
                                       tis_cap=cfg.tis or None)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss ({loss.item()})")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trainer.parameters(), cfg.grad_clip)
        optimizer.step()
        minibatch_stats.append({"loss": loss.detach(), "grad_norm": grad_norm.detach(), **stats})
    values = torch.stack([torch.stack(list(s.values())) for s in minibatch_stats]).tolist()  # one device sync
    return old_logp, old_routes, [dict(zip(minibatch_stats[0], row)) for row in values]


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
def run(cfg, base_state=None):
    """Warm-start (or reuse), then GRPO for cfg.steps. Returns the run directory."""
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
    print(f"run {cfg.run_name}: {json.dumps(dataclasses.asdict(cfg))}")

    task = build_task(cfg)
    model, tokenizer = build_model(cfg, task)
    if base_state is None:
        warmstart(cfg, model, task, tokenizer)
    else:
        model.load_state_dict(base_state)  # --compare: every recipe from the one warm-start
    train_mode, rollout_mode, use_rac = RECIPES[cfg.recipe]
    rac_ratio = cfg.rac_ratio if use_rac else 0.0

    # the rollout engine and a BF16 copy for evaluating the trainer's own weights
    rollout_dtype = torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32
    rollout_model = rac.convert_for_rollout(copy.deepcopy(model).to(rollout_dtype), rollout_mode, rac_ratio=rac_ratio)
    eval_model = rac.convert_for_rollout(copy.deepcopy(model).to(rollout_dtype), "bf16")
    trainer = qat.convert_for_training(model, train_mode)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99))

    calib_rng = random.Random(cfg.seed + 777)
    calib_problems = task.sample(16, "train", calib_rng)
    calib_rows = [tokenizer.encode(p.prompt + task.demonstration(p, calib_rng)) for p in calib_problems]
    calib_width = max(map(len, calib_rows))
    calib_tokens = torch.tensor([r + [tokenizer.pad_id] * (calib_width - len(r)) for r in calib_rows],
                                device=cfg.device)
    eval_problems = task.sample(cfg.eval_prompts, "test", random.Random(cfg.seed + 999))

    start_step = 0
    ckpt_path = os.path.join(run_dir, "checkpoint.pt")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if cfg.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=cfg.device, weights_only=True)
        trainer.load_state_dict(ckpt["trainer"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_step = ckpt["step"]
        _truncate_metrics(metrics_path, start_step)
        print(f"resumed {run_dir} at step {start_step}")
    elif os.path.exists(metrics_path):
        os.remove(metrics_path)

    def sync(step):
        rac.sync_weights(rollout_model, trainer)
        if rac_ratio > 0 and step % cfg.rac_refresh == 0:
            rac.calibrate_rac(rollout_model, calib_tokens)

    def save(step):
        atomic_save({"step": step, "trainer": trainer.state_dict(), "optimizer": optimizer.state_dict(),
                     "config": dataclasses.asdict(cfg)}, ckpt_path)

    def evaluate_both():
        rac.sync_weights(eval_model, trainer)
        return {"pass@1": evaluate(cfg, rollout_model, task, tokenizer, eval_problems),
                "pass@1_bf16_trainer": evaluate(cfg, eval_model, task, tokenizer, eval_problems)}

    sync(start_step)
    if start_step == 0:  # the warm-started policy, before any RL: the baseline every curve starts from
        with open(metrics_path, "a") as f:
            f.write(json.dumps({"step": 0, **evaluate_both()}) + "\n")
    G, P = cfg.group_size, cfg.prompts_per_step
    new_tokens = max_new_tokens(cfg, task)
    bar = tqdm(range(start_step, cfg.steps), desc=cfg.run_name, dynamic_ncols=True, initial=start_step, total=cfg.steps)
    last_eval = {}
    mipu_accepted = [r["mipu/accepted"] > 0 for r in _read_metrics(metrics_path) if "mipu/accepted" in r] \
        if cfg.mipu else []  # resumed runs count what they logged before
    step = start_step
    try:
        for step in bar:
            t0 = time.perf_counter()
            # 1. prompts (the data order is a function of the seed and step: resumable)
            problems = task.sample(P, "train", random.Random(cfg.seed * 1_000_003 + step))
            # 2. rollout in the recipe's precision
            out = rollout.generate(rollout_model, encode_prompts(tokenizer, problems), G, new_tokens,
                                   temperature=cfg.temperature, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                                   seed=cfg.seed * 1_000_003 + step, cuda_graph=cfg.cuda_graph)
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
            # 4-5. trainer log-probs (old: the weights that sampled), loss, cfg.minibatches optimizer steps
            try:
                old_logp, routes, minibatch_stats = policy_update(cfg, trainer, optimizer, seq, advantages,
                                                                  shuffle_seed=cfg.seed * 1_000_003 + step)
            except FloatingPointError as error:
                raise FloatingPointError(f"{error} at step {step}: stopping. The last good checkpoint is "
                                         f"kept at {ckpt_path} (resume with --resume after changing what "
                                         f"diverged).") from None
            mismatch = grpo.mismatch_metrics(old_logp, rollout_logp, mask, tis_cap=cfg.tis or None)
            disagreement = (grpo.routing_disagreement(routes, seq.routes, seq.loss_mask)
                            if seq.routes is not None else float("nan"))
            # 6. sync the rollout's weights through nvfp4; MIPU keeps them only if the rollout policy improved
            sync(step + 1)
            if cfg.mipu:
                proxy = grpo.mipu_proxy(rollout.score(rollout_model, seq.tokens, cfg.temperature)[:, 1:],
                                        inference_logp, advantages, mask)
                with torch.no_grad():  # the same estimate for the trainer's policy: what the update believes
                    trainer_logp, _ = trainer_logprobs(cfg, trainer, seq)
                    trainer_proxy = grpo.mipu_proxy(trainer_logp, old_logp, advantages, mask)
                if proxy <= 0:
                    trainer.load_state_dict(before[0])
                    optimizer.load_state_dict(before[1])
                    sync(step + 1)
                mipu_accepted.append(proxy > 0)
            # 7. log, evaluate, checkpoint
            n_tokens = int(out.completion_mask.sum())
            record = {"step": step + 1, "reward": rewards.mean().item(),
                      **update_metrics(cfg, minibatch_stats),
                      "completion_len": n_tokens / out.completion_mask.shape[0],
                      "routing_disagreement": disagreement, "rollout_s": t_rollout,
                      "rollout_tokens_per_s": n_tokens / t_rollout,
                      **{f"mismatch/{k}": v for k, v in mismatch.items()}}
            if cfg.mipu:
                record.update({"mipu/proxy": proxy, "mipu/trainer_proxy": trainer_proxy,
                               "mipu/accepted": float(proxy > 0),
                               "mipu/accept_rate": sum(mipu_accepted) / len(mipu_accepted)})
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                last_eval = evaluate_both()
                record.update(last_eval)
            record["step_s"] = time.perf_counter() - t0
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            bar.set_postfix(reward=f"{record['reward']:.2f}", pass1=f"{last_eval.get('pass@1', float('nan')):.2f}",
                            dlogp=f"{mismatch['abs_diff_mean']:.1e}", max=f"{mismatch['abs_diff_max']:.2f}")
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                save(step + 1)
    except KeyboardInterrupt:
        done = _last_logged_step(metrics_path)
        if done > start_step:
            save(done)
        print(f"\ninterrupted: checkpoint at step {done} in {ckpt_path}; continue with --resume")
        sys.exit(130)
    plot([run_dir], os.path.join(run_dir, "curves.png"))
    return run_dir


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
        raise ValueError(f"--audit {cfg.audit!r}: no checkpoint there; give a run directory holding "
                         f"checkpoint.pt or a checkpoint file")
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    skipped = ("device", "run_name", "compare", "jobs", "resume", "audit", "audit_recipes", "mipu", "tis")
    run_cfg = TrainConfig(**{k: v for k, v in ckpt["config"].items() if k in known and k not in skipped},
                          device=cfg.device)
    task = build_task(run_cfg)
    model, tokenizer = build_model(run_cfg, task)
    model.load_state_dict(ckpt["trainer"])  # QAT layers keep moe.py's parameter names
    problems = task.sample(run_cfg.prompts_per_step, "train", random.Random(run_cfg.seed + 4242))
    calib_rng = random.Random(run_cfg.seed + 777)  # the run's RAC calibration batch
    calib_rows = [tokenizer.encode(p.prompt + task.demonstration(p, calib_rng))
                  for p in task.sample(16, "train", calib_rng)]
    width = max(map(len, calib_rows))
    calib_tokens = torch.tensor([r + [tokenizer.pad_id] * (width - len(r)) for r in calib_rows],
                                device=cfg.device)
    rollout_dtype = torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32
    out_dir = os.path.dirname(os.path.abspath(ckpt_path))

    results = {}
    for recipe in cfg.audit_recipes.split(","):
        train_mode, rollout_mode, use_rac = RECIPES[recipe]
        rac_ratio = run_cfg.rac_ratio if use_rac else 0.0
        rollout_model = rac.convert_for_rollout(copy.deepcopy(model).to(rollout_dtype), rollout_mode,
                                                rac_ratio=rac_ratio)
        if rac_ratio > 0:
            rac.calibrate_rac(rollout_model, calib_tokens)
        trainer = qat.convert_for_training(copy.deepcopy(model), train_mode)
        out = rollout.generate(rollout_model, encode_prompts(tokenizer, problems), run_cfg.group_size,
                               max_new_tokens(run_cfg, task), temperature=run_cfg.temperature,
                               eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, seed=run_cfg.seed + 4242,
                               cuda_graph=cfg.cuda_graph)
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
    with open(md_path, "w") as f:
        f.write(table)
    with open(os.path.join(out_dir, "audit.json"), "w") as f:
        json.dump({"checkpoint": ckpt_path, "step": ckpt["step"], "device": cfg.device,
                   "torch": torch.__version__, "config": dataclasses.asdict(run_cfg), "recipes": results},
                  f, indent=2)
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
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)


def _last_logged_step(path):
    records = _read_metrics(path)
    return records[-1]["step"] if records else 0


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
              ("mismatch/kl_k3", "K3 KL(rollout || trainer)"), ("routing_disagreement", "routing disagreement")]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for run_dir in run_dirs:
        records = _read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        label = os.path.basename(os.path.normpath(run_dir))
        for ax, (key, title) in zip(axes.flat, panels):
            points = [(r["step"], r[key]) for r in records if key in r and r[key] is not None and not math.isnan(r[key])]
            if points and key != "pass@1":
                steps, values = zip(*points)
                points = list(zip(steps, smooth(values, window)))
            if points:
                ax.plot(*zip(*points), label=label, marker="o" if key == "pass@1" else None, markersize=3)
            ax.set_title(title + ("" if key == "pass@1" or window == 1 else f", {window}-step mean"), fontsize=10)
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
        header = ["run", "pass@1 rollout / bf16 trainer"] + [f"{name} @ {', '.join(map(str, marks))}" for name in
                                                               ("mean abs dlogp", "max abs dlogp", "routing disagr.")]
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
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    return TrainConfig(**vars(parser.parse_args(argv)))


def main(argv=None):
    cfg = parse_args(argv)
    if cfg.audit:
        return audit(cfg)
    if not cfg.compare:
        return [run(cfg)]
    # every variant from the same warm-start (computed once) and seed
    variants = [dataclasses.replace(cfg, run_name="", compare="", **parse_variant(spec))
                for spec in cfg.compare.split(",")]
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
    plot(run_dirs, os.path.join(cfg.out_dir, "compare.png"))
    table = summarize(run_dirs)
    with open(os.path.join(cfg.out_dir, "compare.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return run_dirs


if __name__ == "__main__":
    main()
