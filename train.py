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
    rewards   = task.reward(problem, completion)                     # tasks.py, exact verifier
    old_logp  = trainer(tokens [, forced routes])                    # BF16 or QAT trainer
    metrics   = mismatch(old_logp, rollout.logprobs), routing disagreement       # grpo.py
    loss      = grpo.policy_loss(logp, old_logp, advantages [, tis])            # grpo.py
    optimizer.step(); sync_weights(rollout_model, trainer)           # rac.py via nvfp4.quantize_weight
    (recalibrate RAC, evaluate, log, checkpoint)

Recipes: what the trainer's forward computes and what precision the rollout runs in.

    recipe   trainer forward                 rollout linear layers
    bf16     BF16                            BF16
    fp8      BF16                            FP8 W8A8
    nvfp4    BF16                            NVFP4 W4A4                (naive)
    qat      NVFP4 weights (fake-quantized)  NVFP4 W4A4                (trainer side alone)
    rac      BF16                            NVFP4 W4A4 + RAC          (rollout side alone)
    quads    as qat                          as rac                    (both sides: the stable recipe)
    w4a4     NVFP4 weights and activations   NVFP4 W4A4                (the symmetric alternative)

One update per rollout batch (fully on-policy): the trainer's log-probs under the weights that sampled,
`old_logp`, are computed in the same forward that carries the gradient, so the PPO ratio is 1 and the
clip is inactive; what differs from the rollout engine is exactly the mismatch being studied, which
`--tis C` corrects per token. Mismatch is measured on every step, on the completion tokens.

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
    fsdp: bool = False             # under torchrun: shard the trainer with FSDP2 per block instead of replicating it (DDP)

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
        # named like a --compare variant, so runs that differ write to different directories
        ratio = f"@{self.rac_ratio:g}" if RECIPES[self.recipe][2] and self.rac_ratio != DEFAULT_RAC_RATIO else ""
        self.run_name = self.run_name or (self.recipe + ratio + (f"+tis{self.tis:g}" if self.tis else "")
                                          + ("+r3" if self.r3 else ""))


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

    @property
    def main(self):
        return self.rank == 0

    @property
    def enabled(self):
        return self.world_size > 1


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
    return Distributed(dist.get_rank(), dist.get_world_size())


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
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def rank0_first(ranks):
    """A context in which rank 0 runs first and the others after it (e.g. rank 0 computes the warm-start
    and writes its cache, the others load it)."""
    class _RankZeroFirst:
        def __enter__(self):
            if ranks.enabled and not ranks.main:
                dist.barrier()

        def __exit__(self, *exc):
            if ranks.enabled and ranks.main:
                dist.barrier()
    return _RankZeroFirst()


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
        out = rollout.generate(model, encode_prompts(tokenizer, problems[start:stop]), 1, max_new_tokens(cfg, task),
                               temperature=cfg.temperature, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                               seed=cfg.seed + 12345, cuda_graph=cfg.cuda_graph, row_offset=start)
        total = score(task, tokenizer, problems[start:stop], out, 1).sum().item()
    return (all_sum([total], ranks)[0] / len(problems)).item()


def score(task, tokenizer, problems, out, group_size):
    completions = [tokenizer.decode(row[m].tolist()) for row, m in zip(out.completion_ids.cpu(), out.completion_mask.cpu())]
    return torch.tensor([task.reward(problems[i // group_size], text) for i, text in enumerate(completions)])


# ----------------------------------------------------------------------------- one RL run
@dataclass
class Setup:
    """What a run is built from: models, optimizer, data and paths (everything but the loop's state)."""
    cfg: TrainConfig
    task: object
    tokenizer: object
    trainer: torch.nn.Module        # FP32 master weights (fake-quantized forward per recipe); the optimizer steps these
    train_forward: torch.nn.Module  # what the loop calls: DistributedDataParallel(trainer) under torchrun, else trainer
    rollout_model: torch.nn.Module  # the recipe's rollout precision; its weights come from the trainer by sync()
    eval_model: torch.nn.Module     # a BF16 copy of the trainer's weights, for the trainer's own pass@1
    optimizer: torch.optim.Optimizer
    rac_ratio: float                # 0 when the recipe has no RAC
    calib_tokens: torch.Tensor      # (16, W) prompts + demonstrations that choose RAC's compensated blocks
    eval_problems: list             # held-out problems for pass@1
    run_dir: str
    ckpt_path: str
    metrics_path: str
    start_step: int                 # 0, or the checkpoint's step under --resume
    ranks: Distributed              # this process's rank and the world size (1 without torchrun)


def setup(cfg, base_state=None, ranks=SINGLE):
    """Build a run: task, warm-started policy (or base_state), trainer, rollout and evaluation models,
    optimizer, calibration and evaluation data; restore the checkpoint under --resume. -> Setup"""
    task = build_task(cfg)
    model, tokenizer = build_model(cfg, task)
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    if ranks.main:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        print(f"run {cfg.run_name}: {json.dumps(dataclasses.asdict(cfg))}")
    if base_state is None:
        with rank0_first(ranks):  # rank 0 computes (or loads) the warm-start; the others load its cache
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
    train_forward = distribute_trainer(trainer, cfg, ranks)   # before the optimizer: FSDP2 swaps the parameters
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
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        load_trainer_state(trainer, optimizer, ckpt["trainer"], ckpt["optimizer"])
        start_step = ckpt["step"]
        if ranks.main:
            _truncate_metrics(metrics_path, start_step)
            print(f"resumed {run_dir} at step {start_step}")
    elif os.path.exists(metrics_path) and ranks.main:
        os.remove(metrics_path)
    return Setup(cfg, task, tokenizer, trainer, train_forward, rollout_model, eval_model, optimizer, rac_ratio,
                 calib_tokens, eval_problems, run_dir, ckpt_path, metrics_path, start_step, ranks)


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
            "pass@1_bf16_trainer": evaluate(s.cfg, s.eval_model, s.task, s.tokenizer, s.eval_problems, s.ranks)}


def run(cfg, base_state=None, ranks=SINGLE):
    """Warm-start (or reuse), then GRPO for cfg.steps. Returns the run directory."""
    s = setup(cfg, base_state, ranks)
    task, tokenizer, trainer, rollout_model, optimizer = s.task, s.tokenizer, s.trainer, s.rollout_model, s.optimizer
    run_dir, ckpt_path, metrics_path, start_step = s.run_dir, s.ckpt_path, s.metrics_path, s.start_step
    sync(s, start_step)
    if start_step == 0:  # the warm-started policy, before any RL: the baseline every curve starts from
        baseline = evaluate_both(s)
        if ranks.main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps({"step": 0, **baseline}) + "\n")
    G, P = cfg.group_size, cfg.prompts_per_step
    new_tokens = max_new_tokens(cfg, task)
    bar = tqdm(range(start_step, cfg.steps), desc=cfg.run_name, dynamic_ncols=True, initial=start_step, total=cfg.steps,
               disable=not ranks.main)
    last_eval = {}
    step = start_step
    try:
        for step in bar:
            t0 = time.perf_counter()
            # 1. prompts (the data order is a function of the seed and step: resumable)
            problems = task.sample(P, "train", random.Random(cfg.seed * 1_000_003 + step))
            first, last = shard(P, ranks)               # this rank's whole groups (all of them without torchrun)
            problems = problems[first:last]
            # 2. rollout in the recipe's precision
            out = rollout.generate(rollout_model, encode_prompts(tokenizer, problems), G, new_tokens,
                                   temperature=cfg.temperature, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                                   seed=cfg.seed * 1_000_003 + step, cuda_graph=cfg.cuda_graph,
                                   row_offset=first * G)
            _sync_device(cfg)
            t_rollout = time.perf_counter() - t0
            # 3. rewards
            rewards = score(task, tokenizer, problems, out, G).to(cfg.device)
            # 4. trainer log-probs on the same tokens (optionally replaying the rollout's expert routes)
            seq = out.sequences()
            with autocast(cfg):
                logits, routes = s.train_forward(seq.tokens, forced_routes=seq.routes if cfg.r3 else None,
                                                 return_routes=True)
            logp = grpo.token_logprobs(logits[:, :-1].float() / max(cfg.temperature, 1e-6), seq.tokens[:, 1:])
            mask = seq.loss_mask[:, 1:]
            rollout_logp = seq.logprobs[:, 1:]
            # 5. advantages, loss, mismatch
            advantages = grpo.group_advantages(rewards, G)
            loss, stats = grpo.policy_loss(logp, logp.detach(), advantages, mask, cfg.clip_low, cfg.clip_high,
                                           rollout_logprobs=rollout_logp, tis_cap=cfg.tis or None)
            if all_sum([0.0 if torch.isfinite(loss) else 1.0], ranks)[0] > 0:   # any rank: every rank stops
                raise FloatingPointError(
                    f"non-finite loss ({loss.item()}) at step {step}: stopping. The last good checkpoint "
                    f"is kept at {ckpt_path} (resume with --resume after changing what diverged).")
            local_tokens = mask.sum().item()
            (step_tokens,) = all_sum([local_tokens], ranks).tolist()
            # metrics of the whole batch, from every rank's per-token tensors (this rank's own alone without torchrun)
            all_logp, all_rollout_logp = gather_rows(logp.detach(), ranks), gather_rows(rollout_logp, ranks)
            all_mask, all_rewards = gather_rows(mask, ranks, fill=False), gather_rows(rewards, ranks)
            logged_loss = loss
            if ranks.enabled:
                logged_loss, stats = grpo.policy_loss(all_logp, all_logp, gather_rows(advantages, ranks), all_mask,
                                            cfg.clip_low, cfg.clip_high, rollout_logprobs=all_rollout_logp,
                                            tis_cap=cfg.tis or None)
            mismatch = grpo.mismatch_metrics(all_logp, all_rollout_logp, all_mask, tis_cap=cfg.tis or None)
            disagreement = float("nan")
            if seq.routes is not None:
                pairs = seq.loss_mask.sum().item() * routes.shape[0]          # valid (token, layer) pairs
                local = grpo.routing_disagreement(routes, seq.routes, seq.loss_mask) if pairs else 0.0
                disagreed, total_pairs = all_sum([local * pairs, pairs], ranks).tolist()
                disagreement = disagreed / total_pairs if total_pairs else float("nan")
            # 6. step, then sync the rollout's weights through nvfp4. Scaled so that the ranks' averaged
            # gradients are those of the whole batch's token mean (a no-op without torchrun).
            optimizer.zero_grad(set_to_none=True)
            (loss * (local_tokens * ranks.world_size / step_tokens)).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(trainer.parameters(), cfg.grad_clip)
            optimizer.step()
            sync(s, step + 1)
            # 7. log, evaluate, checkpoint
            n_tokens, n_rows = all_sum([out.completion_mask.sum().item(), out.completion_mask.shape[0]], ranks).tolist()
            record = {"step": step + 1, "reward": all_rewards.mean().item(), "loss": logged_loss.item(),
                      "grad_norm": grad_norm.item(), "completion_len": n_tokens / n_rows,
                      "routing_disagreement": disagreement, "rollout_s": t_rollout,
                      "rollout_tokens_per_s": n_tokens / t_rollout, **{k: float(v) for k, v in stats.items()},
                      **{f"mismatch/{k}": v for k, v in mismatch.items()}}
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                last_eval = evaluate_both(s)
                record.update(last_eval)
            record["step_s"] = time.perf_counter() - t0
            if ranks.main:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            bar.set_postfix(reward=f"{record['reward']:.2f}", pass1=f"{last_eval.get('pass@1', float('nan')):.2f}",
                            dlogp=f"{mismatch['abs_diff_mean']:.1e}", max=f"{mismatch['abs_diff_max']:.2f}")
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                save(s, step + 1)
    except KeyboardInterrupt:
        done = _last_logged_step(metrics_path)
        if done > start_step:
            save(s, done)
        if ranks.main:
            print(f"\ninterrupted: checkpoint at step {done} in {ckpt_path}; continue with --resume")
        sys.exit(130)
    if ranks.main:
        plot([run_dir], os.path.join(run_dir, "curves.png"))
    return run_dir


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
    ranks = init_distributed(cfg)
    if ranks.enabled or cfg.fsdp:
        return [run_distributed(cfg, ranks)]
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


def run_distributed(cfg, ranks):
    """One run under torchrun: every rank runs the same loop on its share of each step's groups."""
    if not ranks.enabled:
        raise SystemExit("train.py: error: --fsdp shards the trainer across torchrun ranks: run it as "
                         "torchrun --nproc_per_node=N train.py --fsdp ...")
    if cfg.compare or cfg.jobs > 1:
        raise SystemExit("train.py: error: --compare and --jobs run several processes of their own: "
                         "run them without torchrun")
    if cfg.prompts_per_step < ranks.world_size:
        raise SystemExit(f"train.py: error: --prompts-per-step {cfg.prompts_per_step} is smaller than the "
                         f"{ranks.world_size} torchrun ranks: each rank needs at least one prompt group")
    try:
        return run(cfg, ranks=ranks)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
