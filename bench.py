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
    raise NotImplementedError


# ---------------------------------------------------------------------------- model (moe.py)
def bench_model(args):
    raise NotImplementedError


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
