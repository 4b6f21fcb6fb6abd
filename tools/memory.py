"""The memory plan: what one GPU holds during an RL step, known before the first step runs.

    python -m tools.memory --world-size 8 --fsdp --grad-checkpoint --gpu-gb 80   # Qwen3-30B-A3B
    python -m tools.memory --preset-overrides n_layers=4 --micro-batch 4 --gpu-gb 80

A run either fits or dies out of memory after minutes of loading; the plan says which beforehand,
and when it does not fit, which flags would make it fit (fitting_flags tries them in the plan).
From the config: P parameters, Q of them quantized by the rollout (attention projections and
experts), B a block's, R the root's (embeddings, final norm, LM head), M the nn.Linear matrices
(projections, routers, LM head), X the experts'. S = world size under --fsdp, else 1. Per GPU:

  held through the step
    trainer weights  4P / S         FP32 master weights
    gradients        4P / S         FP32; DDP adds 4P of buckets it copies them into
    optimizer        8P / S         AdamW's two FP32 moments
    rollout model    b Q + 2(P-Q)   b bytes a quantized weight: bf16 2, fp8 1, nvfp4 and w4a16
                                    0.5625 (4-bit codes, an E4M3 scale per 16), w16a4 4.5625 (it
                                    keeps the FP32 weight); the rest in BF16; whole on every rank
    eval copy        2P             the BF16 copy the trainer's own pass@1 is sampled from
                                    (train.py --no-eval-trainer: none)
    reference model  2P             --kl-coef: the starting policy, frozen, in BF16
    KV cache         4 L Hkv hd n S BF16 keys and values of n rows (a rank's rollout rows and its
                                    held-out prompts) and S slots: the prompt width rounded up to
                                    16, plus the completion, rounded up to 16 (rollout.py's)
  a trainer forward and backward, over m rows of W = prompt + completion tokens (m: the
  micro-batch, else a mini-batch of the rank's rows)
    activations      m W (L a + f)  a bytes saved per token and layer, f once per token (below)
                     m W (4DL + a + f)   per-block checkpointing: each block's FP32 input is
                                    kept, and one block is recomputed at a time
    logits           14 V m W       or 14 V c for chunks of c tokens: the FP32 logits saved for
                                    backward, about two more FP32 copies and a BF16 one in flight
    weight casts     2 (M + X)      autocast's BF16 copies of the weights, saved for backward
                                    (whole, under FSDP too); checkpointed 2 (M + X / L): the
                                    experts of one block (autocast caches M for the whole forward)
    QAT weights      4Q             fake-quantized weights of every layer, each made in its
                                    layer's forward and saved for the backward (qat.py); not bf16;
                                    checkpointed 4Q / L: one block's, remade in its recomputation
    gathered         4R + 12B       FSDP2: the root's parameters, unsharded for the whole pass;
                                    the computing and the prefetched block; a block's unsharded
                                    gradient before its reduce-scatter
  the optimizer step, once the pass has freed its memory
    optimizer step   4P / S         AdamW's foreach path: the square roots of the second moments

total = held + max(training pass, optimizer step); it fits in FIT_FRACTION of the free memory.

The bytes saved per token, a for a layer and f once (BF16 autocast; the GPU's RMSNorm and router
kernels save their inputs and recompute the rest), counted op by op:

    a =  16 D                 FP32 inputs of the two norms; BF16 casts of the inputs of q, k, v
                              and of the router (each linear layer saves its own cast)
       + 2 hd (H + Hkv)       BF16 q and k entering their norms
       + 8 hd H + 4 H         SDPA: q, k and v expanded to H heads, the output, the log-sum-exp
       + 2 E + 8 A            the router's logits and chosen ids
       + A (4 D + 8 I + 18)   per routed copy: the gathered input and the output rows (BF16),
                              gate/up (4I), silu(gate) and the product (2I each), two int64
                              indices and the BF16 routing weight
    f =  6 D                  the final norm's FP32 input, the LM head's BF16 input

fused=False counts the CPU's torch twins of RMSNorm and the router instead (they save their
intermediate values); the tests check that count against what autograd saves on the CPU.
Approximate or left out: the logits' in-flight copies; a backward's own scratch (a few D per
token); the CUDA context, NCCL buffers and the allocator's fragmentation (FIT_FRACTION leaves room
for them); rollout.py's pool, which keeps a KV cache for each batch shape it saw (up to
MAX_POOLED_STATES), counted once; the prefill's logits (2^27 elements at a time); the forward
without gradient that --minibatches and --mipu add (no saved activations, its logits as above).
Measured against torch.cuda.max_memory_allocated on a GPU: the README's scale-out section.
"""

import argparse
import dataclasses
import itertools
import math
import os
import sys
from dataclasses import dataclass
from typing import NamedTuple

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # also as a plain script

import moe  # noqa: E402

GB = 1e9
FIT_FRACTION = 0.9  # of the free memory: the allocator's fragmentation and what the plan leaves out
# bytes a quantized weight of the rollout model takes, per rac.py mode
ROLLOUT_BYTES = {
    "bf16": 2.0,
    "fp8": 1.0,  # plus an FP32 scale per output row: under 1% at these widths
    "nvfp4": 0.5625,
    "w4a16": 0.5625,
    "w16a4": 0.5625 + 4.0,  # the reference path keeps the FP32 weight beside the codes
}
# train.RECIPES' trainer modes (qat.py, symmetric.MODES): all but bf16 fake-quantize their weights
TRAINER_MODES = ("bf16", "qat", "w4a4", "moeresq", "trace")
# train.py's flags that make a plan smaller, in the order a suggestion names them
FLAG_FSDP = "--fsdp"
FLAG_CHECKPOINT = "--grad-checkpoint"
FLAG_MICRO_BATCH = "--micro-batch"
FLAG_PROMPTS = "--prompts-per-step"
FLAG_NO_EVAL_COPY = "--no-eval-trainer"


@dataclass
class Layout:
    """How a run lays out one RL step; with a moe.MoEConfig, what the plan needs."""

    prompts: int = 32  # P prompts a step, over all ranks (train.py --prompts-per-step)
    group_size: int = 8  # G samples a prompt
    prompt_tokens: int = 256  # the longest prompt
    completion_tokens: int = 1024  # the longest completion (--max-new-tokens)
    # the rollout's layers: a key of ROLLOUT_BYTES (rac.py's modes)
    rollout_precision: str = "nvfp4"
    trainer_mode: str = "bf16"  # the trainer's mode; all but bf16 hold fake-quantized weights
    world_size: int = 1  # ranks (GPUs) under torchrun
    fsdp: bool = False  # the trainer sharded over the ranks (FSDP2) instead of copied (DDP)
    grad_checkpoint: bool = False  # blocks recomputed in the backward instead of saved
    micro_batch: int = 0  # trainer rows a forward and backward (0: a whole mini-batch)
    minibatches: int = 1  # optimizer steps a rollout batch, each on 1/N of the rows
    logprob_chunk: int = 0  # tokens whose full-vocabulary logits exist at once (0: a forward's)
    eval_prompts: int = 0  # held-out prompts sampled by the BF16 eval copy, one row each (0: none)
    eval_copy: bool = True  # the BF16 copy of the trainer for its own pass@1
    reference_model: bool = False  # --kl-coef: the starting policy, frozen, in BF16

    def __post_init__(self):
        at_least = dict(
            prompts=1,
            group_size=1,
            prompt_tokens=1,
            completion_tokens=1,
            world_size=1,
            micro_batch=0,
            minibatches=1,
            logprob_chunk=0,
            eval_prompts=0,
        )
        for name, low in at_least.items():
            value = getattr(self, name)
            moe.check(
                isinstance(value, int) and value >= low,
                f"Layout.{name} must be an integer >= {low}, got {value!r}",
            )
        moe.check(
            self.rollout_precision in ROLLOUT_BYTES,
            f"Layout.rollout_precision must be one of {', '.join(ROLLOUT_BYTES)}, "
            f"got {self.rollout_precision!r}",
        )
        moe.check(
            self.trainer_mode in TRAINER_MODES,
            f"Layout.trainer_mode must be one of {', '.join(TRAINER_MODES)}, "
            f"got {self.trainer_mode!r}",
        )

    def rank_rows(self) -> int:
        """A rank's rollout rows: its share of the prompts (the first ranks take one more) x G."""
        return math.ceil(self.prompts / self.world_size) * self.group_size

    def forward_rows(self) -> int:
        """Rows of one trainer forward and backward: a micro-batch, else a mini-batch."""
        minibatch = math.ceil(self.rank_rows() / self.minibatches)
        return min(self.micro_batch, minibatch) if self.micro_batch else minibatch


# ----------------------------------------------------------------------------- counts
class Counts(NamedTuple):
    total: int  # P, a tied head counted once
    quantized: int  # Q: attention projections and experts, what the rollout quantizes
    block: int  # B: one decoder layer's
    root: int  # R: embeddings, final norm, LM head
    linear: int  # M: matrices of nn.Linear layers (projections, routers, LM head), autocast-cached
    experts: int  # X: expert matrices of all layers


def parameter_counts(config: moe.MoEConfig) -> Counts:
    """Parameter counts by formula from the config's widths."""
    c = config
    attention = c.dim * c.n_heads * c.head_dim * 2 + c.dim * c.n_kv_heads * c.head_dim * 2
    experts = 3 * c.n_experts * c.dim * c.expert_dim
    router = c.dim * c.n_experts
    norms = 2 * c.dim + 2 * c.head_dim
    block = attention + experts + router + norms
    head = 0 if c.tie_embeddings else c.vocab_size * c.dim
    root = c.vocab_size * c.dim + head + c.dim
    return Counts(
        total=c.n_layers * block + root,
        quantized=c.n_layers * (attention + experts),
        block=block,
        root=root,
        linear=c.n_layers * (attention + router) + c.vocab_size * c.dim,
        experts=c.n_layers * experts,
    )


def activation_bytes_per_token(config: moe.MoEConfig, fused: bool = True) -> tuple[int, int]:
    """(a, f): bytes autograd saves per token for each decoder layer and once per forward, under
    BF16 autocast (the module docstring derives them). fused=False: the CPU's torch twins of RMSNorm
    and the router, which save their intermediate values instead of recomputing them."""
    D, H, Hkv, hd = config.dim, config.n_heads, config.n_kv_heads, config.head_dim
    E, A, I = config.n_experts, config.n_active, config.expert_dim
    attention = 8 * hd * H + 4 * H  # SDPA's q, k, v, output and log-sum-exp
    experts = A * (4 * D + 8 * I + 18)
    if fused:  # the kernels save their inputs only
        norms = 4 * D + 4 * D + 2 * hd * (H + Hkv)
        router = 2 * E + 8 * A
        final = 4 * D
    else:  # the twins: FP32 input, 1/rms and normalized output; q/k's FP32 copy and BF16 output
        norms = 2 * (8 * D + 4) + 6 * hd * (H + Hkv) + 4 * (H + Hkv)
        router = 4 * E + 12 * A + 4  # softmax output, chosen ids, weights and their sum
        final = 8 * D + 4
    casts = 3 * 2 * D + 2 * D  # BF16 copies of the q/k/v inputs and of the router's input
    per_layer = norms + casts + attention + router + experts
    return per_layer, final + 2 * D  # the LM head's BF16 input


# ----------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    """Bytes per GPU of each part of an RL step (the module docstring derives each)."""

    # held through the whole step
    trainer_weights: float
    gradients: float
    optimizer: float
    rollout_model: float
    eval_copy: float
    reference_model: float
    kv_cache: float
    # held from a trainer forward to the end of its backward
    activations: float  # with the layout's checkpointing
    logits: float
    weight_casts: float
    qat_weights: float
    gathered: float
    # the optimizer step's scratch, after the pass's memory is freed
    optimizer_step: float
    # not a part: the activations with the other choice of checkpointing, to show what it changes
    activations_other: float

    def held(self) -> float:
        return sum(getattr(self, name) for name in HELD)

    def training_pass(self) -> float:
        return sum(getattr(self, name) for name in TRAINING_PASS)

    def total(self) -> float:
        return self.held() + max(self.training_pass(), self.optimizer_step)

    def fits(self, free_bytes: float) -> bool:
        return self.total() <= FIT_FRACTION * free_bytes

    def table(self, free_bytes: float | None = None, checkpointed: bool = False) -> str:
        """The plan as lines of GB, the total beside the free memory (checkpointed: the layout's
        --grad-checkpoint, to label the activations' other value)."""

        def line(name, value, note=""):
            return f"  {name.replace('_', ' '):<20} {value / GB:9.2f} GB{note}"

        other = "without" if checkpointed else "with"
        lines = ["held through the step"]
        lines += [line(name, getattr(self, name)) for name in HELD]
        lines.append("a trainer forward and backward")
        for name in TRAINING_PASS:
            note = ""
            if name == "activations":
                note = f"  ({other} {FLAG_CHECKPOINT}: {self.activations_other / GB:.2f} GB)"
            lines.append(line(name, getattr(self, name), note))
        lines.append(line("optimizer step", self.optimizer_step, "  (after the pass)"))
        lines.append(line("total", self.total()))
        if free_bytes is not None:
            verdict = "fits" if self.fits(free_bytes) else "does not fit"
            lines.append(f"  {verdict} in {FIT_FRACTION:.0%} of the {free_bytes / GB:.2f} GB free")
        return "\n".join(lines)


HELD = (
    "trainer_weights",
    "gradients",
    "optimizer",
    "rollout_model",
    "eval_copy",
    "reference_model",
    "kv_cache",
)
TRAINING_PASS = ("activations", "logits", "weight_casts", "qat_weights", "gathered")


def plan(config: moe.MoEConfig, layout: Layout) -> Plan:
    """Per-GPU bytes of an RL step of `config` laid out as `layout`."""
    counts = parameter_counts(config)
    P, Q = counts.total, counts.quantized
    sharded = layout.fsdp and layout.world_size > 1
    shards = layout.world_size if sharded else 1
    ddp = layout.world_size > 1 and not sharded

    cache_bytes_per_slot = 2 * config.n_layers * config.n_kv_heads * config.head_dim * 2
    slots = 16 * math.ceil(
        (16 * math.ceil(layout.prompt_tokens / 16) + layout.completion_tokens) / 16
    )
    eval_rows = math.ceil(layout.eval_prompts / layout.world_size)
    kv_cache = cache_bytes_per_slot * slots * (layout.rank_rows() + eval_rows)

    per_layer, per_forward = activation_bytes_per_token(config)
    tokens = layout.forward_rows() * (layout.prompt_tokens + layout.completion_tokens)
    saved_all = tokens * (config.n_layers * per_layer + per_forward)
    saved_inputs = tokens * (config.n_layers * 4 * config.dim + per_layer + per_forward)
    logit_tokens = layout.logprob_chunk or tokens
    cast_weights = counts.linear + counts.experts
    qat_bytes = 4 * Q
    if layout.grad_checkpoint:  # the experts' casts and the QAT weights of one block at a time
        cast_weights = counts.linear + counts.experts / config.n_layers
        qat_bytes = 4 * Q / config.n_layers
    return Plan(
        trainer_weights=4 * P / shards,
        gradients=4 * P / shards + (4 * P if ddp else 0),
        optimizer=8 * P / shards,
        rollout_model=ROLLOUT_BYTES[layout.rollout_precision] * Q + 2 * (P - Q),
        eval_copy=2 * P if layout.eval_copy else 0,
        reference_model=2 * P if layout.reference_model else 0,
        kv_cache=kv_cache,
        activations=saved_inputs if layout.grad_checkpoint else saved_all,
        activations_other=saved_all if layout.grad_checkpoint else saved_inputs,
        logits=14 * config.vocab_size * logit_tokens,
        weight_casts=2 * cast_weights,
        qat_weights=qat_bytes if layout.trainer_mode != "bf16" else 0,
        gathered=4 * counts.root + 12 * counts.block if sharded else 0,
        optimizer_step=4 * P / shards,
    )


# ----------------------------------------------------------------------------- what would fit
def candidate_layouts(layout: Layout):
    """(flags, layout) for every combination of the flags that shrink a plan, the layout's own
    first: --fsdp (with several ranks), --grad-checkpoint, --micro-batch halved down to 1,
    --no-eval-trainer (no BF16 evaluation copy), and fewer --prompts-per-step (halved, at least one
    a rank)."""
    fsdp = [layout.fsdp]
    if layout.world_size > 1 and not layout.fsdp:
        fsdp.append(True)
    checkpoint = [layout.grad_checkpoint]
    if not layout.grad_checkpoint:
        checkpoint.append(True)
    micro, rows = [layout.micro_batch], layout.forward_rows()
    while rows > 1:
        rows = rows // 2
        micro.append(rows)
    eval_copy = [layout.eval_copy]
    if layout.eval_copy:
        eval_copy.append(False)
    prompts, count = [layout.prompts], layout.prompts
    while count // 2 >= layout.world_size:
        count = count // 2
        prompts.append(count)
    for shard, recompute, rows, copy, count in itertools.product(
        fsdp, checkpoint, micro, eval_copy, prompts
    ):
        flags = []
        if shard != layout.fsdp:
            flags.append(FLAG_FSDP)
        if recompute != layout.grad_checkpoint:
            flags.append(FLAG_CHECKPOINT)
        if rows != layout.micro_batch:
            flags.append(f"{FLAG_MICRO_BATCH} {rows}")
        if copy != layout.eval_copy:
            flags.append(FLAG_NO_EVAL_COPY)
        if count != layout.prompts:
            flags.append(f"{FLAG_PROMPTS} {count}")
        candidate = dataclasses.replace(
            layout,
            fsdp=shard,
            grad_checkpoint=recompute,
            micro_batch=rows,
            eval_copy=copy,
            prompts=count,
        )
        yield flags, candidate


def fitting_flags(config: moe.MoEConfig, layout: Layout, free_bytes: float) -> str | None:
    """None when the plan fits in free_bytes; else one line: the plan's total and largest parts,
    and the flags that make it fit, found by trying them in the plan (fewer prompts only when
    nothing else fits, then no evaluation copy only when nothing else does; the fewest flags; the
    largest micro-batch), or that nothing tried fits."""
    current = plan(config, layout)
    if current.fits(free_bytes):
        return None
    parts = sorted(((getattr(current, name), name) for name in HELD + TRAINING_PASS), reverse=True)
    largest = ", ".join(f"{name.replace('_', ' ')} {gb(value)}" for value, name in parts[:3])
    head = (
        f"the memory plan needs {gb(current.total())} a GPU ({largest}), more than "
        f"{FIT_FRACTION:.0%} of the {gb(free_bytes)} free"
    )
    fitting = []
    for flags, candidate in candidate_layouts(layout):
        candidate_plan = plan(config, candidate)
        if candidate_plan.fits(free_bytes):
            shrunk = candidate.prompts < layout.prompts
            no_copy = candidate.eval_copy != layout.eval_copy
            order = (shrunk, no_copy, len(flags), -candidate.prompts, -candidate.forward_rows())
            fitting.append((order, flags, candidate_plan.total()))
    if fitting:
        _, flags, total = min(fitting)
        return f"{head}: it fits with {' '.join(flags)} ({gb(total)})"
    tried = [
        (plan(config, candidate).total(), flags) for flags, candidate in candidate_layouts(layout)
    ]
    total, flags = min(tried)
    smallest = " ".join(flags) if flags else "the layout as given: no flag shrinks it"
    return (
        f"{head}; nothing tried fits (the smallest plan, {gb(total)}, is {smallest}): more GPUs, "
        "or a smaller model"
    )


def gb(n_bytes: float) -> str:
    return f"{n_bytes / GB:.3g} GB"


def max_layers(config: moe.MoEConfig, layout: Layout, free_bytes: float) -> int:
    """The most decoder layers of config's shapes whose plan fits in free_bytes (0 if none)."""
    layers = 0
    while plan(dataclasses.replace(config, n_layers=layers + 1), layout).fits(free_bytes):
        layers += 1
    return layers


def free_memory(device) -> float | None:
    """Free bytes on a CUDA device (what the plan is compared with); None on the CPU."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return float(torch.cuda.mem_get_info(device)[0])


# ----------------------------------------------------------------------------- command line
def main(argv=None):
    """Print the plan of a preset laid out as the flags say; with --gpu-gb, how it fits."""
    from tools import runs

    parser = runs.Parser(
        prog="python -m tools.memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset", default="qwen3-30b-a3b", help=f"one of {', '.join(moe.PRESETS)}"
    )
    parser.add_argument("--preset-overrides", default="", help="fields replaced, e.g. n_layers=4")
    for field in dataclasses.fields(Layout):
        flag = "--" + field.name.replace("_", "-")
        if isinstance(field.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        elif field.name == "logprob_chunk":  # train.py chunks the log-probs by the vocabulary
            help_text = "tokens a log-prob chunk (default: train.py's, moe.logprob_chunk_tokens)"
            parser.add_argument(flag, type=int, default=None, help=help_text)
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    parser.add_argument("--gpu-gb", type=float, help="free memory a GPU, in GB (1e9 bytes)")
    args = vars(parser.parse_args(argv))
    try:
        runs.require(args["preset"] in moe.PRESETS, "preset", args["preset"], "not a preset")
        overrides = runs.preset_overrides(args["preset"], args["preset_overrides"])
        config = moe.MoEConfig.from_preset(args["preset"], **overrides)
        if args["logprob_chunk"] is None:
            args["logprob_chunk"] = moe.logprob_chunk_tokens(config.vocab_size)
        layout = Layout(**{field.name: args[field.name] for field in dataclasses.fields(Layout)})
    except ValueError as error:  # a ConfigError, or a Layout value
        parser.error(str(error))
    free_bytes = args["gpu_gb"] * GB if args["gpu_gb"] else None
    result = plan(config, layout)
    print(f"{config}\n{layout}\n{result.table(free_bytes, layout.grad_checkpoint)}")
    if free_bytes is not None:
        print(fitting_flags(config, layout, free_bytes) or "no flag needed")
        print(
            f"  the most layers of these shapes that fit: {max_layers(config, layout, free_bytes)}"
        )
    return result


if __name__ == "__main__":
    main()
