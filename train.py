"""GRPO with NVFP4 rollouts and BF16 training, and the two-sided fix that keeps them aligned.

    python train.py                              # the default experiment (quads), ~1 min on a CPU
    python train.py --recipe nvfp4 --steps 300   # the naive recipe
    python train.py --model path/to/qwen3-moe --task gsm8k --recipe quads
    torchrun --nproc_per_node=8 train.py --recipe quads [--fsdp]    # every GPU of one node

One RL step, as `rl_step` reads:

    problems  = task.sample(P, "train")                          # tasks.py
    rollout   = generate(rollout_model, prompts, G)              # rollout.py, rollout precision
    rewards   = task.reward(problem, completion)                 # tasks.py, exact verifier
    A         = group advantages of the rewards                  # grpo.py
    for each of N mini-batches:                                  # --minibatches N (default 1)
        new_logp = trainer(tokens [, forced routes (R3)])        # the recipe's trainer
        loss     = grpo.policy_loss(new_logp, old_logp, A)       # ratio new/old [, TIS weight]
        optimizer.step()
    metrics   = mismatch(old_logp, rollout.logprobs)             # grpo.py, routing disagreement
    sync_weights(rollout_model, trainer)                         # rac.py, nvfp4.quantize_weight
    (--mipu: keep the update only if the synced rollout policy improved)
    log the step to metrics.jsonl; pass@1 every eval_every steps; a checkpoint every
    checkpoint_every steps

Read it first along the bf16 recipe: the rollout and the trainer are the same BF16 model, and every
line above is plain GRPO. A recipe (RECIPES) then sets the rollout's linear layers (rac.py's modes,
read next) and the trainer's forward: bf16, fp8 and nvfp4 train in BF16; qat fake-quantizes the
trainer's weights (qat.py), rac adds RAC to the NVFP4 rollout, quads does both; w4a4, moeresq and
trace quantize the trainer's activations too (symmetric.py); w4a16, qat-w4a16 and w16a4 quantize one
rollout operand (--act-scale row: activation scales per row).

What a trainer takes from the rollout travels as arguments, never as state set on a layer: R3's
routes are the forward's forced_routes; moeresq's RAC masks (a snapshot taken right after the
rollout) and trace's recorded codes (rac.InputRecorder, handed to the decode steps) form a
symmetric.RolloutShare, which the trainer's forward receives as moe.py's hand_offs.

By default one update per rollout batch: `old_logp` is the forward that carries the gradient,
detached, so the PPO ratio is 1 and what differs from the rollout engine is exactly the mismatch
studied (`--tis C` corrects it per token). `--minibatches N`: N optimizer steps on shuffled rows, so
clip-higher acts. `--mipu`: ratios against the rollout's log-probs; an update is kept only if the
synced rollout raises the batch's advantage-weighted likelihood (grpo.mipu_proxy), else weights and
optimizer are restored.

The starting policy: a supervised warm-start on the task's (deliberately imperfect) demonstrations,
cached. In tools/: a run's directory, checkpoints, --resume, Ctrl-C and config checks (runs.py),
torchrun (distributed.py), the comparison, figures, the audit. Defaults: on a CPU the tiny preset
and a short run, on a GPU the small preset and the full experiment. Every field of TrainConfig is a
flag (see --help).
"""

import copy
import dataclasses
import json
import math
import os
import random
import shutil
import socket
import time
import urllib.parse
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

import grpo
import moe
import nvfp4
import qat
import rac
import rollout
import symmetric
import tasks
from tools import distributed, logger, memory, runs
from tools.distributed import SINGLE
from tools.runs import (
    ConfigError,
    HeldInterrupt,
    atomic_save,
    check_run_dir,
    load_checkpoint,
    one_line,
    read_metrics,
    write_text,
)

# recipe -> (the trainer's mode: bf16, qat or a symmetric.MODES mode; the rollout's mode for
# rac.convert_for_rollout; whether the rollout compensates with RAC)
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
    "w4a16": ("bf16", "w4a16", False),
    "qat-w4a16": ("qat", "w4a16", False),
    "w16a4": ("bf16", "w16a4", False),
}
CHOICES = {
    "recipe": RECIPES,
    "preset": moe.PRESETS,
    "task": tasks.TASKS,  # checked, and listed in --help
    "act_scale": nvfp4.ACT_SCALES,
    "log_to": logger.PACKAGES,
}


@dataclass
class TrainConfig:
    # run
    out_dir: str = "runs"  # one directory per run
    run_name: str = ""  # the run's directory under out_dir ("" = recipe and switches: nvfp4+tis2)
    resume: bool = False  # continue the run from its checkpoint (same config; --steps may grow)
    overwrite: bool = False  # start over where a run is (deletes the run's directory)
    warmstart_dir: str = "runs/warmstart"  # the warm-start cache, shared by every --out-dir
    seed: int = 0  # model init, warm-start, data order and sampling all derive from it
    device: str = ""  # cpu, cuda or cuda:N ("" = cuda if available, else cpu)
    threads: int | None = None  # torch's CPU threads (default 1 on the tiny preset)
    checkpoint_every: int = 25  # steps between checkpoints (also written at the end and on Ctrl-C)
    cuda_graph: bool = True  # decode steps as a captured CUDA graph (GPU only)
    fsdp: bool = False  # under torchrun: shard the trainer per block (FSDP2) instead of DDP
    log_to: str | None = None  # also send metrics.jsonl's records to TensorBoard or W&B
    # model and task
    preset: str | None = None  # model size (default tiny on CPU, small on GPU; none with --model)
    preset_overrides: str = ""  # preset fields replaced, e.g. "dim=128,head_dim=32,expert_dim=128"
    model: str = ""  # a Hugging Face Qwen3-MoE directory or hub id (needs --task gsm8k)
    task: str = "arith"  # arith: built in, with its own tokenizer; gsm8k: needs --model
    task_source: str = ""  # gsm8k: a .jsonl/.json/.parquet file or a hub dataset (openai/gsm8k)
    difficulty: int | None = None  # arith: digits per operand (default 2 on CPU, 3 on GPU)
    demo_error_rate: float = 0.5  # share of demonstrations with one mistake (room for RL)
    # RL
    steps: int | None = None  # RL steps (default 60 on CPU, 200 on GPU)
    prompts_per_step: int | None = None  # P, prompts per step (default 16 on CPU, 32 on GPU)
    group_size: int = 8  # G, samples per prompt: GRPO's advantages compare them
    lr: float | None = None  # AdamW learning rate of RL (default 1e-4 on tiny, else 2e-5)
    temperature: float = 1.0  # sampling temperature (the trainer's log-probs use it too)
    max_new_tokens: int | None = None  # completion cap (default the task's longest + EOS)
    clip_low: float = 0.2  # PPO ratio clip below 1 - clip_low
    clip_high: float = 0.28  # PPO ratio clip above 1 + clip_high (clip-higher, as in DAPO)
    clip_ratio_c: float = 3.0  # dual-clip: a token with A < 0 loses at most c |A| (0 = off)
    kl_coef: float = 0.0  # K3 KL penalty to the starting policy (GRPO's reference term; 0 = off)
    grad_clip: float = 1.0  # max global gradient norm
    minibatches: int = 1  # optimizer steps per rollout batch, each on a shuffled 1/N of its rows
    micro_batch: int = 0  # rows per forward/backward, gradients accumulated (0 = a mini-batch)
    grad_checkpoint: bool = False  # recompute each block in the backward (activation checkpointing)
    memory_check: bool = True  # GPU: refuse a run whose memory plan does not fit (tools/memory.py)
    mipu: bool = False  # MIPU: ratios against the rollout; keep an update only if it improves
    warmstart_steps: int | None = None  # supervised steps (default 300 on CPU, 1500 on GPU)
    warmstart_batch: int = 64  # demonstrations per warm-start step
    warmstart_lr: float | None = None  # warm-start peak lr (default 3e-3 on tiny, else 1e-3)
    eval_every: int | None = None  # steps between evaluations (default steps // 5; also 0, last)
    eval_prompts: int | None = None  # held-out prompts for pass@k (default 128 on CPU, 512 on GPU)
    eval_samples: int | None = None  # completions per eval prompt, for pass@k (default G; CPU 1)
    # pass@k also of the trainer's weights, from a BF16 copy of them (2 bytes a parameter a GPU)
    eval_trainer: bool = True
    # recipe switches
    recipe: str = "quads"  # the trainer's and the rollout's precision (RECIPES)
    tis: float = 0.0  # truncated importance sampling cap C (0 = off; verl uses 2)
    r3: bool = False  # replay the rollout's expert routes in the trainer (R3)
    rac_ratio: float = 0.5  # fraction of activation blocks compensated by RAC (rac, quads, moeresq)
    rac_refresh: int = 1  # recalibrate the RAC block selection every N weight syncs
    act_scale: str = "tensor"  # NVFP4 activations' global scale: per tensor (paper) or per row

    def __post_init__(self):
        runs.validate(self, CHOICES)
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        gpu = self.device.startswith("cuda")
        if self.preset is None and not self.model:
            self.preset = "small" if gpu else "tiny"
        # checked here, applied in build_model
        runs.preset_overrides(self.preset, self.preset_overrides)
        tiny = self.preset == "tiny"
        defaults = dict(
            difficulty=(3 if gpu else 2) if self.task == "arith" else None,
            steps=200 if gpu else 60,
            prompts_per_step=32 if gpu else 16,
            lr=1e-4 if tiny else 2e-5,
            warmstart_steps=1500 if gpu else 300,
            warmstart_lr=3e-3 if tiny else 1e-3,
            eval_prompts=512 if gpu else 128,
            eval_samples=self.group_size if gpu else 1,
        )
        for name, default in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        self.eval_every = max(1, self.steps // 5) if self.eval_every is None else self.eval_every
        runs.require(
            runs.is_int(self.micro_batch) and self.micro_batch >= 0,
            "micro-batch",
            self.micro_batch,
            "must be an integer >= 0 (0: a whole mini-batch at once)",
        )
        runs.require(
            self.minibatches <= self.prompts_per_step * self.group_size,
            "minibatches",
            self.minibatches,
            f"must be at most prompts x group size = {self.prompts_per_step * self.group_size}",
        )
        # torchrun: each rank needs rows for every mini-batch
        world = int(os.environ.get("WORLD_SIZE", 1))
        runs.require(
            self.prompts_per_step // world * self.group_size >= self.minibatches,
            "prompts-per-step",
            self.prompts_per_step,
            f"must give each of the {world} ranks at least --minibatches "
            f"{self.minibatches} rows ({self.group_size} per prompt)",
        )
        runs.refuse(
            self.act_scale != "tensor" and RECIPES[self.recipe][1] not in rac.ACTIVATION_MODES,
            "act-scale",
            f"{self.act_scale!r} scales NVFP4 activations; recipe {self.recipe} has none",
        )
        rac_recipes = ", ".join(name for name, (_, _, has_rac) in RECIPES.items() if has_rac)
        for name in ("rac_ratio", "rac_refresh"):
            runs.refuse(
                getattr(self, name) != getattr(TrainConfig, name) and not RECIPES[self.recipe][2],
                name,
                f"recipe {self.recipe} has no RAC, so the value would change nothing; RAC "
                f"recipes: {rac_recipes}",
            )
        if self.task == "arith" and self.max_new_tokens is not None:
            longest = tasks.ArithmeticTask(self.difficulty).max_completion_chars
            runs.require(
                self.max_new_tokens >= longest,
                "max_new_tokens",
                self.max_new_tokens,
                f"must be at least {longest}, the longest completion of the arith task at "
                f"--difficulty {self.difficulty} (shorter, the answers are cut off and every "
                "reward is 0)",
            )
        logger.check_available(self.log_to)
        self.run_name = self.run_name or variant_name(self)


def variant_name(cfg, ratio_given=False):
    """recipe[@rac_ratio][+row][+tisC][+r3][+mbN][+mipu][+preset overrides]: the ratio when not the
    default, or when asked; the overrides as given (quads+dim=128,head_dim=32), so that a resized
    model does not land in the run directory of the preset's own size."""
    ratio = RECIPES[cfg.recipe][2] and (ratio_given or cfg.rac_ratio != TrainConfig.rac_ratio)
    return (
        cfg.recipe
        + (f"@{cfg.rac_ratio:g}" if ratio else "")
        + "+row" * (cfg.act_scale == "row")
        + (f"+tis{cfg.tis:g}" if cfg.tis else "")
        + "+r3" * cfg.r3
        + (f"+mb{cfg.minibatches}" if cfg.minibatches > 1 else "")
        + "+mipu" * cfg.mipu
        + (f"+{cfg.preset_overrides}" if cfg.preset_overrides else "")
    )


# ----------------------------------------------------------------------------- the starting policy
def build_task(cfg):
    """The task, loaded; a dataset that cannot be loaded is a ConfigError naming the source and the
    fix."""
    if cfg.task == "arith":
        return tasks.make_task(
            "arith", difficulty=cfg.difficulty, demo_error_rate=cfg.demo_error_rate, seed=cfg.seed
        )
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"argument --task: {cfg.task} loads its problems with the `datasets` package, which "
            "is not installed (pip install datasets)"
        ) from None
    source = cfg.task_source or "openai/gsm8k"
    try:
        return tasks.make_task(cfg.task, source=source, seed=cfg.seed)
    except FileNotFoundError as error:
        raise ConfigError(f"argument --task-source: {error}") from None
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as error:
        cause = f"; {one_line(error.__cause__)}" if error.__cause__ else ""
        raise ConfigError(
            f"argument --task-source: cannot load the {cfg.task} dataset {source!r} "
            f"({one_line(error)}{cause}); offline, give a local file: --task-source "
            "FILE.jsonl (one JSON object per line with 'question' and 'answer')"
        ) from None


def build_model(cfg, task):
    """The BF16 policy before warm-start: a preset with the task's vocabulary, or a real
    checkpoint."""
    torch.manual_seed(cfg.seed)
    if not cfg.model:
        config = moe.MoEConfig.from_preset(
            cfg.preset,
            vocab_size=task.tokenizer.vocab_size,
            **runs.preset_overrides(cfg.preset, cfg.preset_overrides),
        )
        model = moe.MoETransformer(config)
        model.init_weights()
        return model.to(cfg.device), task.tokenizer
    source = model_source(cfg.model)
    try:
        model, hf_tokenizer = moe.load_hf(source)
    except (OSError, ValueError) as error:
        # no config.json, weights that do not fit, a hub that stopped answering
        where = "the directory" if os.path.isdir(cfg.model) else "no such directory, and the hub id"
        raise ConfigError(
            f"argument --model: cannot load {cfg.model} ({where}): {one_line(error)}"
        ) from None
    if hf_tokenizer is None:
        raise ConfigError(
            f"argument --model: {cfg.model} has no tokenizer files (tokenizer.json, "
            "tokenizer_config.json or vocab.json); RL needs one"
        )
    try:
        return model.to(cfg.device), tasks.HFTokenizer(hf_tokenizer)
    except ValueError as error:
        raise ConfigError(f"argument --model: {error}") from None


def model_source(model):
    """--model as moe.load_hf takes it: a local directory as given; a hub id as given when the hub
    answers, else its snapshot in the local Hugging Face cache. One quick connection decides, so
    that a machine without network gets one line at once instead of the hub client's retries."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import constants, snapshot_download

    if constants.HF_HUB_OFFLINE:
        reason = "HF_HUB_OFFLINE is set"
    elif any(os.environ.get(name) for name in PROXY_VARIABLES):
        return model  # through a proxy a direct connection proves nothing: the client decides
    else:
        endpoint = urllib.parse.urlparse(constants.ENDPOINT)
        port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
        try:
            socket.create_connection((endpoint.hostname, port), timeout=5).close()
            return model
        except OSError as error:
            reason = f"{endpoint.hostname} cannot be reached ({one_line(error)})"
    try:
        return snapshot_download(model, local_files_only=True)
    except (OSError, ValueError):  # huggingface_hub's LocalEntryNotFoundError is an OSError
        raise ConfigError(
            f"argument --model: {model} is not in the local Hugging Face cache and {reason}; give "
            f"a local directory, or download it where the hub is reachable (hf download {model})"
        ) from None


PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def autocast(cfg):
    """BF16 compute with FP32 master weights on the GPU; plain FP32 on the CPU (exact, for
    tests)."""
    if cfg.device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


# ----------------------------------------------------------------------------- warm-start
def warmstart(cfg, model, task, tokenizer):
    """Supervised fine-tuning on demonstrations (loss on completion + EOS tokens), cached on disk
    (runs.warmstart_path: one cache for every out_dir). No steps: the model as built or loaded,
    with nothing written (a real checkpoint is not copied into the cache)."""
    if cfg.warmstart_steps == 0:
        return model
    path = runs.warmstart_path(cfg)
    if os.path.exists(path):
        model.load_state_dict(
            load_checkpoint(path, cfg.device, "delete it to recompute it", "warm-start cache")
        )
        print(f"warm-start: loaded {path}")
        return model
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rng = random.Random(cfg.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.warmstart_lr, weight_decay=0.0, betas=(0.9, 0.95)
    )
    bar = tqdm(range(cfg.warmstart_steps), desc="warm-start", dynamic_ncols=True)
    for step in bar:
        warmup = min(1.0, (step + 1) / 50)
        lr = cfg.warmstart_lr * warmup * 0.5 * (1 + math.cos(math.pi * step / cfg.warmstart_steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        rows = [
            (
                tokenizer.encode(p.prompt),
                tokenizer.encode(task.demonstration(p, rng)) + [tokenizer.eos_id],
            )
            for p in task.sample(cfg.warmstart_batch, "train", rng)
        ]  # (prompt, target) ids
        width = max(len(a) + len(b) for a, b in rows)
        tokens = torch.tensor(
            [a + b + [tokenizer.pad_id] * (width - len(a) - len(b)) for a, b in rows]
        )
        target_mask = torch.tensor(
            [[len(a) <= i < len(a) + len(b) for i in range(width)] for a, b in rows]
        )
        tokens, target_mask = tokens.to(cfg.device), target_mask.to(cfg.device)
        with autocast(cfg):
            # the targets' log-probs, a chunk of positions at a time (moe.py): (N, W-1) fp32
            logp = model(tokens[:, :-1], targets=tokens[:, 1:], grad_checkpoint=cfg.grad_checkpoint)
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


def rollout_dtype(cfg):  # it and the two helpers below serve tools/ too
    return torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32


def encode_prompts(tokenizer, problems):
    return [tokenizer.encode(p.prompt) for p in problems]


def max_new_tokens(cfg, task):
    return cfg.max_new_tokens or getattr(task, "max_completion_chars", 256) + 1


# ------------------------------------------------------------------------- evaluation and reward
@torch.no_grad()
def evaluate(cfg, model, task, tokenizer, problems, ranks=SINGLE, kept=0):
    """pass@k on the held-out problems for k = 1, 2, 4, ... up to cfg.eval_samples (and it): that
    many completions per prompt, sampled at the training temperature, each k the unbiased estimate
    (pass_at_k) averaged over the prompts. Each rank samples its share of the prompts; row ids
    follow the prompt's index, so the result is the same. -> ({"pass@k": value}, the first
    completion of each of the first `kept` prompts as {prompt, answer, completion, reward})."""
    samples = cfg.eval_samples
    ks = sorted({2**i for i in range(samples.bit_length()) if 2**i <= samples} | {samples})
    start, stop = distributed.shard(len(problems), ranks)
    totals = [0.0] * len(ks)
    kept_samples = []
    if stop > start:
        out = rollout.generate(
            model,
            encode_prompts(tokenizer, problems[start:stop]),
            samples,
            max_new_tokens(cfg, task),
            temperature=cfg.temperature,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            seed=cfg.seed + 12345,
            cuda_graph=cfg.cuda_graph,
            row_offset=start * samples,
        )
        texts = completion_texts(tokenizer, out)
        rewards = [
            task.reward(problems[start + row // samples], text) for row, text in enumerate(texts)
        ]
        for prompt in range(stop - start):
            correct = sum(r == 1.0 for r in rewards[prompt * samples : (prompt + 1) * samples])
            for i, k in enumerate(ks):
                totals[i] += pass_at_k(correct, samples, k)
        for prompt in range(min(kept, stop - start)):
            problem = problems[start + prompt]
            kept_samples.append(
                {
                    "prompt": problem.prompt,
                    "answer": problem.answer,
                    "completion": texts[prompt * samples],
                    "reward": rewards[prompt * samples],
                }
            )
    sums = distributed.all_sum(totals, ranks)
    metrics = {f"pass@{k}": (sums[i] / len(problems)).item() for i, k in enumerate(ks)}
    return metrics, kept_samples


def pass_at_k(correct, samples, k):
    """The unbiased estimate of pass@k from `samples` completions of one prompt, `correct` of them
    right (reward 1): 1 - C(samples - correct, k) / C(samples, k), the chance that k of them drawn
    without replacement hold a right one (Chen et al. 2021). With one sample, pass@1 is its
    reward."""
    if samples - correct < k:
        return 1.0
    return 1.0 - math.comb(samples - correct, k) / math.comb(samples, k)


def completion_texts(tokenizer, out):
    """The decoded completions of a rollout, one per row."""
    return [
        tokenizer.decode(row[m].tolist())
        for row, m in zip(out.completion_ids.cpu(), out.completion_mask.cpu())
    ]


def score(task, tokenizer, problems, out, group_size):
    texts = completion_texts(tokenizer, out)
    return torch.tensor(
        [task.reward(problems[i // group_size], text) for i, text in enumerate(texts)]
    )


# --------------------------------------------------------------------- the two sides of a recipe
def build_recipe(cfg, model, recipe, rac_ratio):
    """A recipe's two sides from one policy: the rollout model (a converted copy in the rollout's
    precision) and the trainer (model itself, converted in place)."""
    train_mode, rollout_mode, _ = RECIPES[recipe]
    rollout_model = copy.deepcopy(model).to(rollout_dtype(cfg))
    rollout_model = rac.convert_for_rollout(
        rollout_model, rollout_mode, rac_ratio=rac_ratio, act_scale=cfg.act_scale
    )
    trainer = model
    if train_mode == "qat":
        trainer = qat.convert_for_training(model)
    elif train_mode in symmetric.MODES:
        trainer = symmetric.convert_for_training(model, train_mode, act_scale=cfg.act_scale)
    return rollout_model, trainer


# ----------------------------------------------------------------------------- the policy update
def trainer_logprobs(cfg, trainer, seq, share=None, rows=slice(None)):
    """The trainer's log-probs of the sampled tokens of `rows`, tempered as the rollout sampled
    them: (n, W-1) fp32, aligned with seq.logprobs[:, 1:]; the experts it chose, (L, n, W, A); and
    its policy's entropy at each of those positions, (n, W-1) fp32, without gradient.

    The model returns the log-probs of its targets rather than its logits (moe.py computes them a
    chunk of positions at a time: the fp32 logits of the whole batch never exist at once); the last
    column has no target. With --r3 the trainer replays the rollout's routes (forced_routes); with
    --grad-checkpoint each block is recomputed in the backward. share: what a symmetric trainer
    takes from the rollout (symmetric.RolloutShare, or None), handed to its layers as arguments of
    this forward (moe.py's hand_offs)."""
    tokens = seq.tokens[rows]
    targets = F.pad(tokens[:, 1:], (0, 1))  # (n, W): the next token; the last column has none
    forced_routes = None
    if cfg.r3:
        forced_routes = seq.routes[:, rows]
    hand_offs = None
    if share is not None:
        if not isinstance(rows, slice):
            share = share.select_rows(rows, seq.tokens.shape[1])
        model = getattr(trainer, "module", trainer)  # DDP wraps the trainer; paths are the model's
        hand_offs = share.hand_offs(model)
    with autocast(cfg):
        (logprobs, entropy), routes = trainer(
            tokens,
            forced_routes=forced_routes,
            return_routes=True,
            hand_offs=hand_offs,
            targets=targets,
            temperature=cfg.temperature,
            grad_checkpoint=cfg.grad_checkpoint,
            return_entropy=True,
        )
    return logprobs[:, :-1], routes, entropy[:, :-1]


def micro_batches(rows, n_rows, size):
    """The rows of one mini-batch (a slice of all n_rows, or an index tensor) in pieces of at most
    `size` rows for gradient accumulation; [rows] itself when it fits (size 0: no limit)."""
    index = rows
    if isinstance(rows, slice):
        index = torch.arange(n_rows)
    if size == 0 or len(index) <= size:
        return [rows]
    return list(index.split(size))


def policy_update(
    cfg,
    trainer,
    optimizer,
    seq,
    advantages,
    shuffle_seed,
    rollout_share=None,
    ranks=SINGLE,
    reference_logp=None,
    clock=None,
):
    """GRPO on one rollout batch: cfg.minibatches optimizer steps, each on a shuffled 1/N of its
    rows.

    Three log-probs per token (grpo.py): `rollout` (the engine's), `old` (the trainer under the
    weights that sampled: one forward without gradient first) and `new` (each mini-batch's forward,
    with the gradient). With one mini-batch, old is that forward, detached: the on-policy update.
    The ratio is new / old (new / rollout with --mipu); a mini-batch's loss is normalized by its
    valid tokens (DAPO), a rank's weighted by its share of them (tools/distributed.py).

    --micro-batch R: a mini-batch's forward and backward run R rows at a time, each piece's loss
    normalized by the whole mini-batch's tokens, so the accumulated gradient is the whole
    mini-batch's (to fp32 summation order) and the optimizer still steps once per mini-batch.
    rollout_share: what a symmetric trainer takes from the rollout (trainer_logprobs).
    reference_logp (N, W-1): the starting policy's log-probs for --kl-coef's K3 term, else None.
    clock: a StepClock, charged with "logprobs" (the forwards) and "update" (loss, backward, step).
    Returns old (N, W-1), the trainer's routes under the sampling weights (L, N, W, A) and per
    mini-batch a dict of floats (loss, grad_norm and grpo.policy_loss's statistics)."""
    if clock is None:
        clock = StepClock("cpu")
    mask = seq.loss_mask[:, 1:]
    rollout_logp = seq.logprobs[:, 1:]
    n_rows = seq.tokens.shape[0]
    clock.lap("logprobs")  # the reference policy's forward (--kl-coef), if any
    minibatches = [slice(None)]
    if cfg.minibatches > 1:
        with torch.no_grad():
            old_logp, old_routes = no_grad_logprobs(cfg, trainer, seq, rollout_share)
        clock.lap("logprobs")
        generator = torch.Generator().manual_seed(shuffle_seed + 7919 * ranks.rank)
        order = torch.randperm(n_rows, generator=generator).to(seq.tokens.device)
        minibatches = order.chunk(cfg.minibatches)
    minibatch_stats = []
    for rows in minibatches:
        pieces = micro_batches(rows, n_rows, cfg.micro_batch)
        # DAPO's denominator: the mini-batch's valid tokens, also when it runs in pieces
        tokens = None
        if len(pieces) > 1:
            tokens = mask[rows].sum().item()
        loss_weight = distributed.token_share(mask[rows], ranks)
        optimizer.zero_grad(set_to_none=True)
        stats = {}
        for piece in pieces:
            new_logp, routes, entropy = trainer_logprobs(cfg, trainer, seq, rollout_share, piece)
            clock.lap("logprobs")
            if cfg.minibatches == 1 and len(pieces) == 1:
                old_logp = new_logp.detach()
                old_routes = routes
            elif cfg.minibatches == 1:
                if piece is pieces[0]:
                    old_logp = torch.empty_like(rollout_logp)
                    old_routes = routes.new_empty(routes.shape[0], n_rows, *routes.shape[2:])
                old_logp[piece] = new_logp.detach()
                old_routes[:, piece] = routes
            reference = old_logp
            if cfg.mipu:
                reference = rollout_logp
            loss, piece_stats = grpo.policy_loss(
                new_logp,
                reference[piece],
                advantages[piece],
                mask[piece],
                cfg.clip_low,
                cfg.clip_high,
                rollout_logprobs=rollout_logp[piece],
                tis_cap=cfg.tis or None,
                clip_ratio_c=cfg.clip_ratio_c or None,
                ref_logprobs=None if reference_logp is None else reference_logp[piece],
                kl_coef=cfg.kl_coef,
                num_valid_tokens=tokens,
            )
            # any rank's non-finite loss stops every rank
            not_finite = 0.0 if torch.isfinite(loss) else 1.0
            if distributed.all_sum([not_finite], ranks)[0] > 0:
                raise FloatingPointError(f"non-finite loss ({loss.item()})")
            (loss * loss_weight).backward()
            # the trainer policy's entropy, a token mean over the piece like the other statistics
            piece_mask = mask[piece].float()
            entropy_sum = (entropy * piece_mask).sum()
            piece_stats["entropy"] = entropy_sum / piece_mask.sum().clamp(min=1.0)
            fraction = 1.0
            if tokens is not None:
                fraction = mask[piece].sum().item() / max(tokens, 1)
            accumulate_stats(stats, {"loss": loss.detach(), **piece_stats}, fraction)
            clock.lap("update")
        if ranks.enabled:
            stats = distributed.reduce_stats(stats, loss_weight / ranks.world_size, ranks)
        grad_norm = torch.nn.utils.clip_grad_norm_(trainer.parameters(), cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        clock.lap("update")
        stats = {"loss": stats.pop("loss"), "grad_norm": grad_norm.detach(), **stats}
        minibatch_stats.append(stats)
    # every statistic to the host in one sync
    rows_of_values = []
    for stats in minibatch_stats:
        device = grad_norm.device
        values = [torch.as_tensor(v, dtype=torch.float32, device=device) for v in stats.values()]
        rows_of_values.append(torch.stack(values))
    values = torch.stack(rows_of_values).tolist()
    return old_logp, old_routes, [dict(zip(minibatch_stats[0], row)) for row in values]


def no_grad_logprobs(cfg, trainer, seq, rollout_share):
    """trainer_logprobs of every row without a gradient, cfg.micro_batch rows at a time."""
    pieces = micro_batches(slice(None), seq.tokens.shape[0], cfg.micro_batch)
    results = [trainer_logprobs(cfg, trainer, seq, rollout_share, piece) for piece in pieces]
    logp = torch.cat([logp for logp, _, _ in results])
    routes = torch.cat([routes for _, routes, _ in results], dim=1)
    return logp, routes


# statistics grpo.policy_loss already divides by the whole mini-batch's tokens (num_valid_tokens)
SUMMED_STATS = ("loss", "pg_loss")


def accumulate_stats(total, piece, fraction):
    """Add one micro-batch's statistics to the mini-batch's: the loss terms (already over the
    mini-batch's tokens) add up, a token mean over the piece's own tokens adds with its fraction of
    the mini-batch's tokens, ratio/min and ratio/max take the extreme."""
    for key, value in piece.items():
        if key not in SUMMED_STATS and key not in distributed.MIN_STATS + distributed.MAX_STATS:
            value = value * fraction
        if key not in total:
            total[key] = value
        elif key in distributed.MIN_STATS:
            total[key] = torch.minimum(total[key], value)
        elif key in distributed.MAX_STATS:
            total[key] = torch.maximum(total[key], value)
        else:
            total[key] = total[key] + value


def update_metrics(cfg, minibatch_stats):
    """What the log keeps of one policy update: loss, gradient norm and the clipped fractions (TRL's
    names; 0 on policy, logged always so that every run has them), means over mini-batches; and,
    when they can differ from their on-policy values (not with one mini-batch against old: ratio =
    1), the PPO ratio's mean, min and max and the K3 KL(old || new)."""

    def mean(key):
        return sum(s[key] for s in minibatch_stats) / len(minibatch_stats)

    record = {"loss": mean("loss"), "grad_norm": mean("grad_norm")}
    # the trainer policy's mean token entropy in the update's forwards (verl's actor/entropy)
    record["entropy/trainer"] = mean("entropy")
    clip_keys = [key for key in minibatch_stats[0] if key.startswith("clip_ratio/")]
    record.update({key: mean(key) for key in clip_keys})
    if "kl" in minibatch_stats[0]:  # --kl-coef: K3 KL(new || the starting policy)
        record["kl_to_reference"] = mean("kl")
    if cfg.minibatches > 1 or cfg.mipu:
        record.update({key: mean(key) for key in ("ratio/mean", "approx_kl")})
        record["ratio/min"] = min(s["ratio/min"] for s in minibatch_stats)
        record["ratio/max"] = max(s["ratio/max"] for s in minibatch_stats)
    return record


# ----------------------------------------------------------------------------- one RL run
@dataclass
class Setup:
    """What a run is built from: models, optimizer, data and paths (everything but the loop's
    state)."""

    cfg: TrainConfig
    task: object
    tokenizer: object
    # FP32 master weights, the optimizer's (forward fake-quantized per recipe)
    trainer: torch.nn.Module
    # what the loop calls: DDP(trainer) under torchrun, else the trainer
    train_forward: torch.nn.Module
    # the recipe's rollout precision; sync() loads it from the trainer
    rollout_model: torch.nn.Module
    # a BF16 copy of the trainer's weights, for the trainer's own pass@1 (None: --no-eval-trainer)
    eval_model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    rac_ratio: float  # 0 when the recipe has no RAC
    # (16, W) prompts + demonstrations that choose RAC's compensated blocks
    calib_tokens: torch.Tensor
    eval_problems: list  # held-out problems for pass@1
    run_dir: str  # out_dir/run_name: config.json, metrics.jsonl, checkpoint.pt (tools/runs.py)
    start_step: int  # 0, or the checkpoint's step under --resume
    # this process's rank and the world size (1 without torchrun)
    ranks: distributed.Distributed = SINGLE
    # --kl-coef: the starting policy, frozen, in the rollout's dtype (else None)
    reference_model: torch.nn.Module | None = None
    # tools/memory.py's plan of one GPU, made before the models were built (None on a CPU)
    memory_plan: memory.Plan | None = None

    def __post_init__(self):
        self.ckpt_path = os.path.join(self.run_dir, "checkpoint.pt")
        self.metrics_path = os.path.join(self.run_dir, "metrics.jsonl")


def calibration_tokens(cfg, task, tokenizer):
    """(16, W) prompts + demonstrations on which RAC chooses its compensated blocks (fixed by the
    seed)."""
    rng = random.Random(cfg.seed + 777)
    rows = [
        tokenizer.encode(p.prompt + task.demonstration(p, rng))
        for p in task.sample(16, "train", rng)
    ]
    width = max(map(len, rows))
    return torch.tensor(
        [r + [tokenizer.pad_id] * (width - len(r)) for r in rows], device=cfg.device
    )


def setup(cfg, base_state=None, ckpt=None, ranks=SINGLE):
    """Build a run (-> Setup): task, warm-started policy (or base_state), trainer, rollout and
    evaluation models, optimizer, data; the checkpoint under --resume. Nothing is written before the
    run directory is checked and the task and model are loaded: a run that cannot start leaves the
    disk as it was."""
    ckpt = ckpt if ckpt is not None else check_run_dir(cfg)
    free_bytes = memory.free_memory(cfg.device)  # before this run's models take any
    task = build_task(cfg)
    model, tokenizer = build_model(cfg, task)
    memory_plan = None
    if free_bytes is not None:
        memory_plan = check_memory_plan(cfg, task, model.config, free_bytes, ranks)
    # arith: a char a token
    prompt = getattr(task, "max_prompt_chars", 0)
    completion = max_new_tokens(cfg, task)
    if prompt + completion > model.config.max_seq_len:
        raise ConfigError(
            f"{prompt} prompt + {completion} completion tokens exceed the model's max_seq_len="
            f"{model.config.max_seq_len}: lower --difficulty or --max-new-tokens, or raise "
            "max_seq_len with --preset-overrides"
        )
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    if ranks.main:  # only rank 0 writes
        if cfg.overwrite and os.path.isdir(run_dir):
            # the whole run: metrics, checkpoint and whatever was made from them
            shutil.rmtree(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        config_path = os.path.join(run_dir, "config.json")
        starts = runs.read_provenance(config_path) if ckpt is not None else []
        start = {
            "from_step": ckpt["step"] if ckpt is not None else 0,
            **runs.provenance(cfg.device),
        }
        # one provenance entry per (re)start
        config = {**dataclasses.asdict(cfg), "provenance": starts + [start]}
        write_text(json.dumps(config, indent=2), config_path)
        print(f"run {cfg.run_name}: {json.dumps(dataclasses.asdict(cfg))}")
    if base_state is None:
        # rank 0 computes (or loads) the warm-start; the others load it
        with distributed.rank0_first(ranks):
            warmstart(cfg, model, task, tokenizer)
    else:
        model.load_state_dict(base_state)  # a comparison: every recipe from the one warm-start
    rac_ratio = cfg.rac_ratio if RECIPES[cfg.recipe][2] else 0.0
    eval_model = None
    if cfg.eval_trainer:
        eval_model = copy.deepcopy(model).to(rollout_dtype(cfg))
        eval_model = rac.convert_for_rollout(eval_model, "bf16")
    reference_model = None
    if cfg.kl_coef > 0:  # the starting policy: the warm-start, before any checkpoint is loaded
        reference_model = copy.deepcopy(model).to(rollout_dtype(cfg)).requires_grad_(False)
    rollout_model, trainer = build_recipe(cfg, model, cfg.recipe, rac_ratio)
    # before the optimizer: FSDP2 swaps the parameters
    train_forward = distributed.distribute_trainer(trainer, cfg, ranks)
    optimizer = torch.optim.AdamW(
        trainer.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99)
    )
    eval_problems = task.sample(cfg.eval_prompts, "test", random.Random(cfg.seed + 999))
    s = Setup(
        cfg,
        task,
        tokenizer,
        trainer,
        train_forward,
        rollout_model,
        eval_model,
        optimizer,
        rac_ratio,
        calibration_tokens(cfg, task, tokenizer),
        eval_problems,
        run_dir,
        0,
        ranks,
        reference_model,
        memory_plan,
    )
    if ckpt is not None:
        distributed.load_trainer_state(trainer, optimizer, ckpt["trainer"], ckpt["optimizer"])
        s.start_step = ckpt["step"]
        # drop records logged after the checkpoint (they will be recomputed identically)
        if ranks.main:
            for path in (s.metrics_path, os.path.join(run_dir, "samples.jsonl")):
                kept = [r for r in read_metrics(path) if r["step"] <= s.start_step]
                atomic_save("".join(json.dumps(r) + "\n" for r in kept), path, write_text)
            print(f"resumed {run_dir} at step {s.start_step}")
    # the rollout starts from the trainer's weights (the checkpoint's, on resume)
    sync(s, s.start_step)
    return s


def check_memory_plan(cfg, task, model_config, free_bytes, ranks):
    """Print what one GPU will hold during a step (tools/memory.py's plan: weights, gradients,
    optimizer, rollout model, KV cache, activations, logits) beside its free memory; a plan that
    does not fit is a ConfigError naming the flags that would make it fit (--no-memory-check skips
    the refusal)."""
    layout = memory.Layout(
        prompts=cfg.prompts_per_step,
        group_size=cfg.group_size,
        # arith: a character a token; a task of a real tokenizer: a bound, not a measurement
        prompt_tokens=getattr(task, "max_prompt_chars", 256),
        completion_tokens=max_new_tokens(cfg, task),
        rollout_precision=RECIPES[cfg.recipe][1],
        trainer_mode=RECIPES[cfg.recipe][0],
        world_size=ranks.world_size,
        fsdp=cfg.fsdp,
        grad_checkpoint=cfg.grad_checkpoint,
        micro_batch=cfg.micro_batch,
        minibatches=cfg.minibatches,
        logprob_chunk=moe.logprob_chunk_tokens(model_config.vocab_size),
        eval_prompts=cfg.eval_prompts,
        eval_copy=cfg.eval_trainer,
        reference_model=cfg.kl_coef > 0,
    )
    plan = memory.plan(model_config, layout)
    if ranks.main:
        print("memory plan, one GPU:\n" + plan.table(free_bytes, cfg.grad_checkpoint))
    problem = memory.fitting_flags(model_config, layout, free_bytes)
    if problem is not None and cfg.memory_check:
        raise ConfigError(f"{problem} (or --no-memory-check to try anyway)")
    return plan


def sync(s, step):
    """Trainer -> rollout weights through nvfp4 (bit-identical to a QAT trainer's); every
    rac_refresh syncs, RAC re-chooses its compensated blocks on the calibration batch."""
    distributed.sync_from_trainer(s.rollout_model, s.trainer)
    if s.rac_ratio > 0 and step % s.cfg.rac_refresh == 0:
        rac.calibrate_rac(s.rollout_model, s.calib_tokens)


def save(s, step):
    """Rank 0 writes the whole trainer and optimizer state (gathered from the shards under
    FSDP2)."""
    model_state, optimizer_state = distributed.trainer_state(s.trainer, s.optimizer)
    if s.ranks.main:
        atomic_save(
            {
                "step": step,
                "trainer": model_state,
                "optimizer": optimizer_state,
                "config": dataclasses.asdict(s.cfg),
            },
            s.ckpt_path,
        )


def evaluate_both(s):
    """pass@k on the held-out problems of the rollout model and of the trainer's weights in BF16."""
    return evaluation(s)[0]


SHOWN_SAMPLES = 4  # evaluation completions of the rollout model kept in samples.jsonl


def evaluation(s):
    """evaluate_both's metrics ("pass@k" of the rollout model, "pass@k_bf16_trainer" of the
    trainer's weights unless --no-eval-trainer), and the rollout model's first completions of the
    first held-out prompts."""
    rollout_metrics, samples = evaluate(
        s.cfg, s.rollout_model, s.task, s.tokenizer, s.eval_problems, s.ranks, SHOWN_SAMPLES
    )
    metrics = dict(rollout_metrics)
    if s.eval_model is not None:
        distributed.sync_from_trainer(s.eval_model, s.trainer)
        trainer_metrics, _ = evaluate(
            s.cfg, s.eval_model, s.task, s.tokenizer, s.eval_problems, s.ranks
        )
        metrics.update({f"{name}_bf16_trainer": value for name, value in trainer_metrics.items()})
    return metrics, samples


def write_record(s, record, metric_logger):
    """Rank 0 appends a record to metrics.jsonl and hands it to --log-to's logger (if any)."""
    if not s.ranks.main:
        return
    with open(s.metrics_path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if metric_logger is not None:
        metric_logger.log(record)


def write_samples(s, step, samples):
    """Rank 0 appends an evaluation's sample completions, with their step, to samples.jsonl."""
    if not s.ranks.main:
        return
    lines = [json.dumps({"step": step, "model": "rollout", **sample}) + "\n" for sample in samples]
    with open(os.path.join(s.run_dir, "samples.jsonl"), "a") as f:
        f.write("".join(lines))


def run(cfg, base_state=None, ranks=SINGLE):
    """Warm-start (or reuse), then GRPO for cfg.steps; print a summary. Returns the run
    directory."""
    ckpt = check_run_dir(cfg)
    # every rank has checked the run directory before rank 0 writes to it
    distributed.barrier(ranks)
    if ckpt is not None and ckpt["step"] == cfg.steps:
        run_dir = os.path.join(cfg.out_dir, cfg.run_name)
        if ranks.main:
            print(
                f"run {run_dir} is complete at step {cfg.steps}: nothing to do (--steps N > "
                f"{cfg.steps} extends it)\n{runs.report(cfg, run_dir, runs.warmstart_path(cfg))}"
            )
        return run_dir
    s = setup(cfg, base_state, ckpt, ranks)
    metric_logger = logger.open_logger(cfg, s.run_dir) if ranks.main else None
    try:
        loop(s, metric_logger)
    finally:
        if metric_logger is not None:
            metric_logger.close()
    if ranks.main:
        print(runs.report(cfg, s.run_dir, runs.warmstart_path(cfg), s.start_step))
    return s.run_dir


def loop(s, metric_logger):
    """The step-0 evaluation (the curves' common start), then the RL steps from s.start_step, with
    their checkpoints; Ctrl-C ends it with one line below the progress bar (HeldInterrupt)."""
    cfg, ranks = s.cfg, s.ranks
    if s.start_step == 0:
        metrics, samples = evaluation(s)
        write_record(s, {"step": 0, **metrics}, metric_logger)
        write_samples(s, 0, samples)
    bar = tqdm(
        range(s.start_step, cfg.steps),
        desc=cfg.run_name,
        dynamic_ncols=True,
        initial=s.start_step,
        total=cfg.steps,
        disable=not ranks.main,
    )
    # the bar shows the last pass@1
    evals = [r for r in read_metrics(s.metrics_path) if "pass@1" in r]
    last_eval = {}
    if evals:
        last_eval = {"pass@1": evals[-1]["pass@1"]}
    accepted = [
        r["mipu/accepted"] > 0 for r in read_metrics(s.metrics_path) if "mipu/accepted" in r
    ]
    with HeldInterrupt(s.start_step) as interrupt:
        try:
            for step in bar:
                record = rl_step(s, step, interrupt, accepted, metric_logger)
                last_eval = record if "pass@1" in record else last_eval
                bar.set_postfix(
                    reward=f"{record['reward']:.2f}",
                    pass1=f"{last_eval.get('pass@1', math.nan):.2f}",
                    dlogp=f"{record['mismatch/abs_diff_mean']:.1e}",
                    max=f"{record['mismatch/abs_diff_max']:.2f}",
                )
                stop = interrupt.requested
                if ranks.enabled:  # every rank stops after the same step
                    stop = distributed.all_sum([float(stop)], ranks)[0].item() > 0
                if stop or (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                    save(s, step + 1)
                interrupt.step = step + 1
                interrupt.holding = False
                if stop:
                    bar.close()  # the message goes below the bar, not onto its line
                    interrupt.stop(
                        f"stopped: checkpoint at step {step + 1} in {s.ckpt_path}; continue with "
                        "--resume",
                        ranks,
                    )
        except KeyboardInterrupt:
            bar.close()
            if interrupt.holding:
                # a second Ctrl-C inside a step's update: its weights are half-updated
                interrupt.stop(
                    f"interrupted during step {interrupt.step + 1}'s update: not saved; "
                    f"{s.ckpt_path} keeps the last checkpoint written; continue with --resume",
                    ranks,
                )
            if interrupt.step > s.start_step:  # before this step's update: `step` finished steps
                save(s, interrupt.step)
            interrupt.stop(
                f"interrupted: checkpoint at step {interrupt.step} in {s.ckpt_path}; continue "
                "with --resume",
                ranks,
            )
    bar.close()


class StepClock:
    """Wall time and peak GPU memory of each phase of a step, for metrics.jsonl: `<phase>_s` (the
    phases add up to the step) and, on a GPU, `memory/<phase>_peak_gb` (torch's
    max_memory_allocated within the phase). A phase ends at its lap(); on a GPU a lap waits for
    the queued kernels first, so a phase is charged with its kernels' time, not their launch's."""

    def __init__(self, device):
        self.cuda = device.startswith("cuda")
        self.seconds = {}
        self.peak_gb = {}
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.last = time.perf_counter()

    def lap(self, phase):
        """Charge the time since the last lap (and its memory peak) to `phase`."""
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now
        if self.cuda:
            peak = torch.cuda.max_memory_allocated() / memory.GB
            self.peak_gb[phase] = max(self.peak_gb.get(phase, 0.0), peak)
            torch.cuda.reset_peak_memory_stats()

    def metrics(self):
        record = {f"{phase}_s": seconds for phase, seconds in self.seconds.items()}
        for phase, peak in self.peak_gb.items():
            record[f"memory/{phase}_peak_gb"] = peak
        return record


def rl_step(s, step, interrupt, accepted, metric_logger=None):
    """One RL step (the module docstring): rollout, reward, policy update, metrics, sync (MIPU's
    decision), log (metrics.jsonl and --log-to's logger; every eval_every steps pass@k and
    samples.jsonl). A Ctrl-C from the first optimizer step to the metrics line is held
    (HeldInterrupt)."""
    cfg, ranks = s.cfg, s.ranks
    interrupt.step, interrupt.holding = step, False
    t0 = time.perf_counter()
    clock = StepClock(cfg.device)
    # 1-2. this rank's whole groups of the step's prompts (a function of seed and step), rolled out
    problems = s.task.sample(
        cfg.prompts_per_step, "train", random.Random(cfg.seed * 1_000_003 + step)
    )
    first, last = distributed.shard(cfg.prompts_per_step, ranks)
    problems = problems[first:last]
    out, rollout_share = sample(s, problems, first, step)
    clock.lap("rollout")
    # 3. rewards and group advantages
    rewards = score(s.task, s.tokenizer, problems, out, cfg.group_size).to(cfg.device)
    advantages = grpo.group_advantages(rewards, cfg.group_size)
    seq = out.sequences()
    clock.lap("reward")
    before = mipu_before(s, seq) if cfg.mipu else None
    # 4-5. trainer log-probs, loss, cfg.minibatches optimizer steps; a Ctrl-C is held from here
    interrupt.holding = True
    try:
        old_logp, routes, minibatch_stats = policy_update(
            cfg,
            s.train_forward,
            s.optimizer,
            seq,
            advantages,
            cfg.seed * 1_000_003 + step,
            rollout_share,
            ranks,
            reference_logprobs(s, seq),
            clock,
        )
    except FloatingPointError as error:
        raise FloatingPointError(
            f"{error} at step {step}: stopping. The last good checkpoint is kept at "
            f"{s.ckpt_path} (resume with --resume after changing what diverged)."
        ) from None
    record = {
        "step": step + 1,
        **step_metrics(s, out, seq, rewards, old_logp, routes, minibatch_stats, clock),
    }
    clock.lap("metrics")
    # 6. sync the rollout's weights through nvfp4; MIPU keeps them only if the rollout improved
    sync(s, step + 1)
    if cfg.mipu:
        decision = mipu_decide(s, step, seq, advantages, old_logp, rollout_share, before, accepted)
        record.update(decision)
    clock.lap("sync")
    # 7. evaluate, log
    if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
        metrics, samples = evaluation(s)
        record.update(metrics)
        write_samples(s, step + 1, samples)
        clock.lap("eval")
    record.update(clock.metrics())
    record["step_s"] = time.perf_counter() - t0
    if step == s.start_step and clock.cuda and ranks.main:
        print(measured_memory(s, clock))
    write_record(s, record, metric_logger)
    return record


def measured_memory(s, clock):
    """One line for the log after a process's first step on a GPU: the GB its held tensors take
    (the plan's first rows, counted from the tensors themselves), each phase's peak, and the plan's
    total beside them."""

    def gb(tensors):
        total = 0
        for tensor in tensors:
            if hasattr(tensor, "to_local"):  # FSDP2's DTensor: this rank's shard
                tensor = tensor.to_local()
            total += tensor.numel() * tensor.element_size()
        return f"{total / memory.GB:.2f}"

    parameters = list(s.trainer.parameters())
    gradients = [p.grad for p in parameters if p.grad is not None]
    moments = [v for state in s.optimizer.state.values() for v in state.values() if v.dim() > 0]
    rollout_tensors = [*s.rollout_model.parameters(), *s.rollout_model.buffers()]
    eval_copy = []
    if s.eval_model is not None:
        eval_copy = list(s.eval_model.parameters())
    reference = []
    if s.reference_model is not None:
        reference = list(s.reference_model.parameters())
    held = (
        f"trainer weights {gb(parameters)}, gradients {gb(gradients)}, optimizer "
        f"{gb(moments)}, rollout model {gb(rollout_tensors)}, eval copy {gb(eval_copy)}, "
        f"reference model {gb(reference)}"
    )
    peaks = ", ".join(f"{phase} {peak:.2f}" for phase, peak in clock.peak_gb.items())
    planned = "no plan"
    if s.memory_plan is not None:
        planned = f"plan {s.memory_plan.total() / memory.GB:.2f}"
    return f"memory, GB: held {held}; peak by phase {peaks}; {planned}"


def sample(s, problems, first, step):
    """The rollout of this rank's groups in the recipe's precision -> (rollout.Rollout, what a
    symmetric trainer takes from it: a symmetric.RolloutShare, or None for the other trainers).

    moeresq takes a snapshot of the rollout's RAC block masks, those that sampled this batch (the
    sync after the update recalibrates the rollout's own). trace takes the codes the rollout's
    quantizers produced: a fresh rac.InputRecorder hands each NVFP4 layer a slot through the decode
    steps' forward (eager decode), and returns the completion tokens' codes after the rollout."""
    cfg, tokenizer = s.cfg, s.tokenizer
    recorder = rollout_recorder(cfg, s.rollout_model)
    decode_hand_offs = None
    if recorder is not None:
        decode_hand_offs = recorder.hand_offs()
    out = rollout.generate(
        s.rollout_model,
        encode_prompts(tokenizer, problems),
        cfg.group_size,
        max_new_tokens(cfg, s.task),
        temperature=cfg.temperature,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        seed=cfg.seed * 1_000_003 + step,
        row_offset=first * cfg.group_size,
        cuda_graph=cfg.cuda_graph,
        decode_hand_offs=decode_hand_offs,
    )
    rollout_share = share_of_rollout(cfg, s.rollout_model, out, recorder)
    return out, rollout_share


def rollout_recorder(cfg, rollout_model):
    """trace: a fresh recorder of what the rollout's layers quantize (rac.InputRecorder, with the
    run's act_scale), to hand to the decode steps; None for every other recipe."""
    if RECIPES[cfg.recipe][0] != "trace":
        return None
    return rac.InputRecorder(rollout_model, cfg.act_scale)


def share_of_rollout(cfg, rollout_model, out, recorder=None):
    """What the recipe's trainer takes from the rollout that sampled `out`: moeresq a snapshot of
    the rollout's RAC masks, trace the recorded codes (symmetric.RolloutShare); None for the
    others."""
    train_mode = RECIPES[cfg.recipe][0]
    if train_mode == "moeresq":
        return symmetric.RolloutShare(masks=rac.rac_masks(rollout_model))
    if train_mode == "trace":
        return symmetric.RolloutShare(codes=recorder.codes(out))
    return None


def step_metrics(s, out, seq, rewards, old_logp, routes, minibatch_stats, clock):
    """The step's metrics over the whole batch, from every rank's per-token tensors."""
    ranks, mask = s.ranks, seq.loss_mask[:, 1:]
    gather = distributed.gather_rows
    rollout_logp = gather(seq.logprobs[:, 1:], ranks)
    valid = gather(mask, ranks, fill=False)
    mismatch = grpo.mismatch_metrics(
        gather(old_logp, ranks), rollout_logp, valid, tis_cap=s.cfg.tis or None
    )
    disagreement = math.nan  # under --r3: the trainer routers' own top-k, which the replay overrode
    if seq.routes is not None:
        pairs = seq.loss_mask.sum().item() * routes.shape[0]  # valid (token, layer) pairs
        local = grpo.routing_disagreement(routes, seq.routes, seq.loss_mask) if pairs else 0.0
        disagreement = distributed.weighted_mean([local], pairs, ranks)[0]
    n_tokens, n_rows = distributed.all_sum(
        [out.completion_mask.sum().item(), out.completion_mask.shape[0]], ranks
    ).tolist()
    return {
        "reward": gather(rewards, ranks).mean().item(),
        # the rollout policy's entropy, estimated from the log-probs of the tokens it sampled
        "entropy/rollout": grpo.sampled_entropy(rollout_logp, valid).item(),
        **update_metrics(s.cfg, minibatch_stats),
        "completion_len": n_tokens / n_rows,
        "routing_disagreement": disagreement,
        "rollout_tokens_per_s": n_tokens / clock.seconds["rollout"],
        **{f"mismatch/{k}": v for k, v in mismatch.items()},
    }


@torch.no_grad()
def reference_logprobs(s, seq):
    """--kl-coef: the starting policy's log-probs of the batch, (N, W-1), else None."""
    if s.reference_model is None:
        return None
    return no_grad_logprobs(s.cfg, s.reference_model, seq, None)[0]


def mipu_before(s, seq):
    """MIPU, before the update: what a rejected candidate restores, and the rollout policy's
    log-probs."""
    state = copy.deepcopy(s.trainer.state_dict()), copy.deepcopy(s.optimizer.state_dict())
    return state, rollout.score(s.rollout_model, seq.tokens, s.cfg.temperature)[:, 1:]


def mipu_decide(s, step, seq, advantages, old_logp, rollout_share, before, accepted):
    """MIPU, after the sync: keep the candidate if the synced rollout policy's proxy improved, else
    restore the weights and optimizer state (and sync again). Every rank decides on the whole
    batch's proxy."""
    cfg, mask, (state, inference_logp) = s.cfg, seq.loss_mask[:, 1:], before
    proxy = grpo.mipu_proxy(
        rollout.score(s.rollout_model, seq.tokens, cfg.temperature)[:, 1:],
        inference_logp,
        advantages,
        mask,
    )
    with torch.no_grad():  # the same estimate for the trainer's policy: what the update believes
        trainer_logp = no_grad_logprobs(cfg, s.trainer, seq, rollout_share)[0]
    trainer_proxy = grpo.mipu_proxy(trainer_logp, old_logp, advantages, mask)
    if s.ranks.enabled:
        proxy, trainer_proxy = distributed.weighted_mean(
            [proxy, trainer_proxy], mask.sum().item(), s.ranks, 0.0
        )
    if proxy <= 0:
        s.trainer.load_state_dict(state[0])
        s.optimizer.load_state_dict(state[1])
        sync(s, step + 1)
    accepted.append(proxy > 0)
    return {
        "mipu/proxy": proxy,
        "mipu/trainer_proxy": trainer_proxy,
        "mipu/accepted": float(proxy > 0),
        "mipu/accept_rate": sum(accepted) / len(accepted),
    }


# ----------------------------------------------------------------------------- CLI
def build_parser(
    prog="train.py",
    usage="python train.py [--recipe R] [options] (see --help)",
    description=__doc__,
):
    """The CLI, built from TrainConfig by runs.build_parser: one option per field, its comment the
    help."""
    return runs.build_parser(TrainConfig, CHOICES, prog, usage, description)


def parse_args(argv=None):
    """Command line -> TrainConfig (a bad value raises ConfigError, as TrainConfig does)."""
    return TrainConfig(**vars(build_parser().parse_args(argv)))


def main(argv=None):
    """The command line: one run (under torchrun, one rank's). A ConfigError exits 2 with its one
    line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = TrainConfig(**vars(args))
        # here, not in run(): a program that imports train.py keeps its own setting
        runs.set_threads(cfg)
        ranks = distributed.init_distributed(cfg)
        return [distributed.run_distributed(run, cfg, ranks) if ranks.enabled else run(cfg)]
    except ConfigError as error:
        parser.error(str(error))
    except KeyboardInterrupt:
        runs.interrupted_before_rl()


if __name__ == "__main__":
    main()
