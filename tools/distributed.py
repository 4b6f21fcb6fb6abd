"""Scale-out under torchrun: one process per GPU, SPMD and colocated.

Every rank holds a rollout model and a trainer, samples and scores its share of each step's prompts
(whole GRPO groups) and computes its share of the loss. A rank's loss is (sum of its tokens' losses)
/ (tokens of the whole batch) * world_size, so that DDP's gradient average is exactly the
single-process gradient of the whole batch; the sampling noise follows each row's id in the whole
batch (rollout.py), so the ranks sample exactly the rollouts one process would. Metrics come from
the per-token tensors gathered from every rank: the same numbers as one process. Only rank 0 writes
files and draws the progress bar. With --fsdp the trainer is sharded per transformer block (FSDP2's
fully_shard) instead of copied whole (DDP).

Without torchrun `init_distributed` returns SINGLE and every helper here is the identity (or a
no-op): train.py reads the same with one process or many. Beyond one node the same script runs under
`torchrun --nnodes`; nothing here is a home-made communication layer."""

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import rac


@dataclass(frozen=True)
class Distributed:
    rank: int = 0
    world_size: int = 1
    enabled: bool = False  # under torchrun (a process group exists), even with one process

    @property
    def main(self):
        return self.rank == 0


SINGLE = Distributed()


def init_distributed(cfg):
    """Under torchrun (RANK and WORLD_SIZE set): join the process group (NCCL on GPUs, gloo on CPUs)
    and take this rank's GPU. Without torchrun: the single process, nothing initialized."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return SINGLE
    if not dist.is_initialized():
        cuda = cfg.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    return Distributed(dist.get_rank(), dist.get_world_size(), enabled=True)


def shard(n, ranks):
    """This rank's contiguous share [start, stop) of n items (the first n % world ranks take one
    more)."""
    per, extra = divmod(n, ranks.world_size)
    start = ranks.rank * per + min(ranks.rank, extra)
    return start, start + per + (ranks.rank < extra)


def gather_rows(x, ranks, fill=0):
    """Concatenate every rank's rows (N_r, T_r, ...) in rank order, padding dim 1 to the widest with
    `fill`. (Collectives want one shape on every rank: rows are padded too, and the padding dropped
    again.)"""
    if not ranks.enabled:
        return x
    shapes = [None] * ranks.world_size
    dist.all_gather_object(shapes, tuple(x.shape))
    rows = max(shape[0] for shape in shapes)
    padded = list(x.shape)
    padded[0] = rows
    if x.dim() > 1:
        padded[1] = max(shape[1] for shape in shapes)
    flag = x.dtype == torch.bool  # gloo gathers no bools: send bytes
    buffer = torch.full(padded, fill, dtype=torch.uint8 if flag else x.dtype, device=x.device)
    buffer[tuple(slice(0, n) for n in x.shape)] = x
    parts = [torch.empty_like(buffer) for _ in shapes]
    dist.all_gather(parts, buffer)
    gathered = torch.cat([part[: shape[0]] for part, shape in zip(parts, shapes)])
    return gathered.bool() if flag else gathered


def all_sum(values, ranks):
    """Element-wise sum over ranks of a float64 vector (counts, sums of rewards)."""
    values = torch.as_tensor(values, dtype=torch.float64)
    if ranks.enabled:
        values = values.to(_collective_device(ranks))
        dist.all_reduce(values)
    return values.cpu()


def weighted_mean(values, weight, ranks, empty=math.nan):
    """Each of `values` (this rank's means) averaged over the ranks, weighted by each rank's
    `weight` (its tokens): one all-reduce; `empty` where no rank has any weight."""
    *sums, total = all_sum([v * weight for v in values] + [weight], ranks).tolist()
    return [v / total if total else empty for v in sums]


def _collective_device(ranks):
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )


def barrier(ranks):
    if ranks.enabled:
        dist.barrier()


@contextlib.contextmanager
def rank0_first(ranks):
    """Rank 0 runs the block first, the others after it (e.g. rank 0 computes the warm-start and
    writes its cache, the others load it)."""
    if not ranks.main:
        barrier(ranks)
    yield
    if ranks.main:
        barrier(ranks)


def distribute_trainer(trainer, cfg, ranks):
    """-> the module the loop calls: DDP(trainer) (gradients averaged across ranks), or with --fsdp
    the trainer itself, sharded in place per transformer block and at the root (FSDP2's
    fully_shard)."""
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
    """rac.sync_weights(target, trainer), also for an FSDP2-sharded trainer: then one block at a
    time is gathered (unshard), re-quantized into the target and released (reshard), so the peak is
    the largest block, never the whole model; the root's own parameters (embeddings, final norm, LM
    head) last."""
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
    """Whole (unsharded) state dicts keyed by parameter name, whatever the world size or sharding,
    so a checkpoint resumes on any number of ranks. Collective under FSDP2: every rank must call
    it."""
    return get_model_state_dict(trainer, options=FULL_STATE), get_optimizer_state_dict(
        trainer, optimizer, options=FULL_STATE
    )


def load_trainer_state(trainer, optimizer, model_state, optimizer_state):
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(trainer, model_state, options=options)
    set_optimizer_state_dict(trainer, optimizer, optimizer_state, options=options)


# grpo.policy_loss statistics that are extremes over the tokens (the rest are token means)
MIN_STATS, MAX_STATS = ("ratio/min",), ("ratio/max",)


def reduce_stats(stats, weight, ranks):
    """A rank's token-mean statistics -> those of all ranks' tokens (weight: this rank's share of
    them); MIN_STATS / MAX_STATS -> the extreme over ranks."""
    keys, device = list(stats), _collective_device(ranks)
    values = torch.stack([stats[key].detach().float().reshape(()) for key in keys]).to(device)
    extreme = torch.tensor([key in MIN_STATS or key in MAX_STATS for key in keys], device=device)
    sign = torch.tensor([-1.0 if key in MIN_STATS else 1.0 for key in keys], device=device)
    summed = torch.where(extreme, 0.0, values * weight)
    dist.all_reduce(summed)  # two collectives for all statistics:
    maxima = torch.where(extreme, values * sign, -math.inf)  # the sums, and the extremes (a minimum
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)  # as the maximum of its negation)
    return dict(zip(keys, torch.where(extreme, maxima * sign, summed)))


def token_share(mask, ranks):
    """The factor on this rank's mini-batch loss (a mean over its own tokens, `mask`) that makes
    DDP's gradient average the token mean of the whole mini-batch: this rank's share of the tokens
    times the world size. 1 without torchrun."""
    if not ranks.enabled:
        return 1.0
    tokens = mask.sum().item()
    return tokens * ranks.world_size / all_sum([tokens], ranks)[0].item()


def run_distributed(run, cfg, ranks):
    """run(cfg, ranks=ranks) on every rank, then leave the process group (after a barrier: every
    rank done with its collectives before the group goes, gloo aborts otherwise)."""
    try:
        result = run(cfg, ranks=ranks)
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()
