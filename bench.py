"""Measured speed of the project's kernels, layers and rollout against their baselines.

    python bench.py quantize        # nvfp4 quantize kernel vs a device-to-device copy
    python bench.py model           # moe.py forward+backward tokens/s (BF16, eager and compiled)
    python bench.py gemm            # rac.py W4A4 dense/grouped GEMMs vs FP8 and BF16
    python bench.py qat             # qat.py training step time: bf16 vs qat vs w4a4
    python bench.py rollout         # rollout.py sampler vs HF generate; decode tokens/s per precision

Each subcommand prints a markdown table (GPU, shapes, median times) that goes into the README as is.
Timings use CUDA events through `triton.testing.do_bench` (median), after warm-up; inputs are random,
never zeros. Bandwidth figures count the bytes each op must read plus write, divided by the measured
time, and are set beside a device-to-device copy measured in the same run.
"""
import argparse
import subprocess
import sys

import torch


def gpu_header():
    """One line naming the GPU, torch/triton versions and git commit, printed above every table."""
    import triton
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # not a git checkout (e.g. a copied tree): say so rather than guess
        commit = "unknown"
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"device: {name} | torch {torch.__version__} | triton {triton.__version__} | commit {commit}"


def bench_ms(fn, warmup=25, rep=100):
    """Median milliseconds of fn() with CUDA events (triton.testing.do_bench)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth(nbytes=1 << 30):
    """Measured device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


# ---------------------------------------------------------------------------- quantize (nvfp4.py)
def bench_quantize(args):
    """Quantize kernel bandwidth against a device-to-device copy of the same BF16 input.

    Bytes counted: the kernel reads x once (2 B/elem) and writes codes (0.5 B) and E4M3 block scales
    (1/16 B). `quantize` with a computed global scale first reads x once more for amax (torch): its
    row counts the logical bytes only, so the extra pass shows as lost bandwidth, not hidden.
    """
    import nvfp4
    rows = []
    for n in (8192, 16384):
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        numel = x.numel()
        dst = torch.empty_like(x)
        copy_ms = bench_ms(lambda: dst.copy_(x))
        copy_bw = 4 * numel / (copy_ms * 1e-3)
        gs = nvfp4.compute_global_scale(x)
        q_bytes = 2 * numel + numel // 2 + numel // 16
        for name, fn, nbytes in [
            ("copy (reference)", lambda: dst.copy_(x), 4 * numel),
            ("quantize kernel, given global scale", lambda: nvfp4.quantize(x, gs), q_bytes),
            ("quantize incl. amax pass", lambda: nvfp4.quantize(x), q_bytes),
            ("amax pass alone", lambda: nvfp4.compute_global_scale(x), 2 * numel),
            ("fake_quantize kernel, given global scale", lambda: nvfp4.fake_quantize(x, gs), 4 * numel),
            ("dequantize kernel", lambda q=nvfp4.quantize(x, gs): nvfp4.dequantize(q), q_bytes),
        ]:
            ms = bench_ms(fn)
            bw = nbytes / (ms * 1e-3)
            rows.append((f"{n}x{n}", name, ms * 1e3, bw / 1e9, 100 * bw / copy_bw))
        del x, dst
    print("| shape | op | time (us) | GB/s | % of copy |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.0f} | {r[4]:.0f}% |")


# ---------------------------------------------------------------------------- model (moe.py)
def bench_model(args):
    """Forward+backward tokens/s of the "small" preset in BF16 on a random training batch, eager vs compiled."""
    import torch.nn.functional as F
    from moe import MoEConfig, MoETransformer

    config = MoEConfig.from_preset("small")
    batch, seq = 32, 256
    torch.manual_seed(0)
    model = MoETransformer(config).to(device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(config.vocab_size, (batch, seq + 1), device="cuda")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def train_step(forward):
        model.zero_grad(set_to_none=True)
        logits = forward(inputs)
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()

    compiled = torch.compile(model)
    train_step(compiled)  # compile outside the timed region
    print(f"\nmoe.py forward+backward, preset small ({model.num_params() / 1e6:.0f}M params, "
          f"{model.num_params(active=True) / 1e6:.0f}M active; D={config.dim} L={config.n_layers} "
          f"E={config.n_experts} A={config.n_active} I={config.expert_dim} V={config.vocab_size}), "
          f"BF16, batch {batch} x {seq} tokens, median of do_bench\n")
    print("| mode | ms / step | tokens/s |")
    print("| --- | ---: | ---: |")
    for mode, forward in (("eager", model), ("torch.compile", compiled)):
        ms = bench_ms(lambda: train_step(forward), warmup=200, rep=1000)
        print(f"| {mode} | {ms:.2f} | {batch * seq / (ms * 1e-3):,.0f} |")


# ---------------------------------------------------------------------------- gemm (rac.py)
def bench_gemm(args):
    raise NotImplementedError


# ---------------------------------------------------------------------------- qat (qat.py)
def bench_qat(args):
    raise NotImplementedError


# ---------------------------------------------------------------------------- rollout (rollout.py)
def bench_rollout(args):
    raise NotImplementedError


COMMANDS = {
    "quantize": bench_quantize,
    "model": bench_model,
    "gemm": bench_gemm,
    "qat": bench_qat,
    "rollout": bench_rollout,
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=list(COMMANDS), nargs="+")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.py measures GPU speed and needs CUDA; none is available here.")
    print(gpu_header())
    for name in args.what:
        COMMANDS[name](args)
