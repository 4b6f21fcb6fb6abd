"""What fits on one node: per-GPU memory of an RL run at N = 1, 2, 8 GPUs, with DDP and with FSDP2.

    python results/memory_table.py            # from the repository root; prints markdown (CPU, ~1 minute)

Parameter counts come from the model itself (built on the meta device); activation memory is measured:
the bytes autograd saves for the backward pass (`torch.autograd.graph.saved_tensors_hooks`, each storage
counted once) of one trainer forward under BF16 autocast, per token, for one decoder layer and for the LM
head's log-probs, on the CPU. The rest is arithmetic, per GPU:

    trainer      FP32 master weights + FP32 gradients + AdamW's two FP32 moments = 16 B per parameter,
                 all of it on every GPU with DDP, 1/N of it with FSDP2 (plus the BF16 copy of the largest
                 gathered block while it computes; prefetching doubles that)
    rollout      every rank holds the whole rollout model: NVFP4 layers 0.5625 B per weight (4-bit codes
                 + one E4M3 scale per 16), the router, embeddings, norms and LM head in BF16
    eval copy    the BF16 copy of the trainer that pass@1 of the trainer's own weights is measured on
    KV cache     rows x (prompt + completion) slots x layers x 2 x Hkv x hd x 2 B (BF16)
    activations  measured bytes per token x the rank's trainer tokens per mini-batch

Left out: CUDA context and allocator slack (a few GB), the prefill path's transient fp16 weight planes (one
layer at a time), NCCL buffers.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402
import moe  # noqa: E402

GB = 1e9
NVFP4_BYTES = 0.5 + 1 / 16          # packed 4-bit codes + one E4M3 block scale per 16 elements
TRAINER_BYTES = 4 + 4 + 8           # FP32 master weight, FP32 gradient, AdamW exp_avg and exp_avg_sq
H200_GB, B200_GB = 141, 192

# (name, preset, overrides, rollout rows per GPU, prompt + completion tokens per row, trainer rows per
# mini-batch). The small preset as train.py's GPU default runs it: 32 prompts x 8 samples of the addition
# task (character vocabulary, rows of about 64 tokens), one mini-batch.
SETTINGS = [
    ("small preset, 256 rows x 64 tokens", "small", dict(vocab_size=32), 256, 64, 256),
    ("Qwen3-30B-A3B shapes, 64 rows x 2k tokens, trainer 2 rows at a time", "qwen3-30b-a3b", {}, 64, 2048, 2),
]


def parameter_counts(config):
    """(total, quantized by the rollout, largest block) parameter counts, from a meta-device model."""
    with torch.device("meta"):
        model = moe.MoETransformer(config)
    total = model.num_params()
    quantized = 0
    for module in model.modules():
        if isinstance(module, moe.Attention):
            quantized += sum(p.numel() for name, p in module.named_parameters()
                             if name.endswith("proj.weight"))
        elif isinstance(module, moe.Experts):
            quantized += sum(p.numel() for p in module.parameters())
    block = max(sum(p.numel() for p in layer.parameters()) for layer in model.layers)
    return total, quantized, block


class SavedBytes:
    """Counts the bytes autograd saves for backward (each storage once), as a context manager."""

    def __init__(self):
        self.seen, self.bytes = set(), 0

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return tensor

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def saved_bytes(config, tokens):
    """Bytes saved for backward by one decoder layer and by the LM head's log-probs, for one sequence of
    `tokens` tokens under BF16 autocast (CPU; causal SDPA saves its output and log-sum-exp, not scores)."""
    torch.manual_seed(0)
    layer = moe.Block(config, 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.02)
    x = torch.randn(1, tokens, config.dim, requires_grad=True)
    positions = torch.arange(tokens)[None]
    cos, sin = moe.rope_cos_sin(positions, config.head_dim, config.rope_theta, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), SavedBytes() as saved_layer:
        layer(x, cos, sin)
    head = torch.nn.Linear(config.dim, config.vocab_size, bias=False)
    targets = torch.randint(config.vocab_size, (1, tokens))
    with torch.autocast("cpu", dtype=torch.bfloat16), SavedBytes() as saved_head:
        grpo.token_logprobs(head(x).float(), targets)
    return saved_layer.bytes, saved_head.bytes


def activation_bytes_per_token(config, tokens=(128, 256)):
    """(one decoder layer, LM head + log-probs) saved bytes per token: the slope between two lengths, so
    that what does not grow with the tokens (autocast's BF16 copies of the weights) is left out."""
    (layer_1, head_1), (layer_2, head_2) = (saved_bytes(config, t) for t in tokens)
    span = tokens[1] - tokens[0]
    return (layer_2 - layer_1) / span, (head_2 - head_1) / span


def table():
    lines = ["| setting | GPUs | mode | trainer states | rollout model | eval copy | KV cache | activations "
             "| total per GPU | fits H200 / B200 | without the eval copy |", "|" + " --- |" * 11]
    for name, preset, overrides, rows, width, train_rows in SETTINGS:
        config = moe.MoEConfig.from_preset(preset, **overrides)
        total, quantized, block = parameter_counts(config)
        per_layer, per_head = activation_bytes_per_token(config)
        rollout = (quantized * NVFP4_BYTES + (total - quantized) * 2) / GB
        eval_copy = total * 2 / GB
        kv = rows * width * config.n_layers * 2 * config.n_kv_heads * config.head_dim * 2 / GB
        activations = train_rows * width * (per_layer * config.n_layers + per_head) / GB
        for gpus in (1, 2, 8):
            for mode in ("DDP", "FSDP2"):
                if mode == "FSDP2" and gpus == 1:
                    continue
                trainer = total * TRAINER_BYTES / GB / (gpus if mode == "FSDP2" else 1)
                if mode == "FSDP2":
                    trainer += 2 * block * 2 / GB      # the gathered BF16 block and the prefetched next one
                used = trainer + rollout + eval_copy + kv + activations
                fits = " / ".join("yes" if used < cap else "no" for cap in (H200_GB, B200_GB))
                lean = " / ".join("yes" if used - eval_copy < cap else "no" for cap in (H200_GB, B200_GB))
                lines.append(f"| {name} | {gpus} | {mode} | {trainer:.1f} | {rollout:.1f} | {eval_copy:.1f} "
                             f"| {kv:.1f} | {activations:.1f} | {used:.1f} | {fits} | {lean} |")
        lines.append(f"| {name}: {total / 1e9:.2f}B parameters "
                     f"({quantized / total:.0%} NVFP4 in the rollout); "
                     f"saved activations {per_layer / 1e3:.1f} kB per token per layer, "
                     f"{per_head / 1e3:.1f} kB "
                     f"per token for the LM head's log-probs | | | | | | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    print("GB (1e9 bytes) per GPU; trainer rows per mini-batch and rollout rows are per GPU.\n")
    print(table())
