"""Measured speed of the project's kernels, layers and rollout against their baselines.

    python bench.py quantize   # nvfp4 quantize kernel vs a device-to-device copy
    python bench.py model      # moe.py forward+backward tokens/s (BF16, eager and compiled)
    python bench.py gemm       # rac.py dense/grouped GEMMs vs FP8, BF16 and int4 W4A16
    python bench.py qat        # qat.py training step time: bf16 vs qat, w4a4, moeresq, trace
    python bench.py rollout    # rollout.py sampler vs HF generate; decode tokens/s per precision
    python bench.py decode     # the second half of `rollout` alone: decode tokens/s per precision
    python bench.py racsweep   # decode tokens/s of NVFP4 rollouts at RAC ratios 0 .. 1 (the sweep)
    python bench.py prefill    # one forward over 4 x 1,024 prompt tokens per precision (CUDA graph)

Each subcommand prints a markdown table with its conditions (GPU, shapes, median times) for
RESULTS.md. Timings use CUDA events through `triton.testing.do_bench` (median), after warm-up;
inputs are random, never zeros. Bandwidth figures count the bytes each op must read plus write,
divided by the measured time, and are set beside a device-to-device copy measured in the same run.
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
    versions = f"torch {torch.__version__} | triton {triton.__version__}"
    return f"device: {name} | {versions} | commit {commit}"


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
            (
                "fake_quantize kernel, given global scale",
                lambda: nvfp4.fake_quantize(x, gs),
                4 * numel,
            ),
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
    """Forward+backward tokens/s of the "small" preset in BF16 on a random training batch, eager vs
    compiled."""
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
    print(
        f"\nmoe.py forward+backward, preset small ({model.num_params() / 1e6:.0f}M params, "
        f"{model.num_params(active=True) / 1e6:.0f}M active; D={config.dim} L={config.n_layers} "
        f"E={config.n_experts} A={config.n_active} I={config.expert_dim} V={config.vocab_size}), "
        f"BF16, batch {batch} x {seq} tokens, median of do_bench\n"
    )
    print("| mode | ms / step | tokens/s |")
    print("| --- | ---: | ---: |")
    for mode, forward in (("eager", model), ("torch.compile", compiled)):
        ms = bench_ms(lambda: train_step(forward), warmup=200, rep=1000)
        print(f"| {mode} | {ms:.2f} | {batch * seq / (ms * 1e-3):,.0f} |")


# ---------------------------------------------------------------------------- gemm (rac.py)
def bench_gemm(args):
    """rac.py's W4A4 kernels against FP8 row-wise, BF16 and torch's int4 weight-only GEMM on
    Qwen3-30B-A3B shapes (D 2048, q 4096, k/v 512, 128 experts top-8, expert hidden 768; for the
    dense gate/up and down shapes, the config's dense intermediate_size 6144), in one run:

    1. dense decode (M = 1, 16, 64, 256), the whole layer: W4A4 = rac.nvfp4_linear_triton (its
       activation quantization included: one quantizer launch, then the tiled GEMM,
       gpu_kernels/w4a4_dense.py); W4A4 RAC 0.5 = the same with half the blocks compensated;
       FP8 = fp8.linear (per-token quantization and the W8A8 GEMM, gpu_kernels/w8a8_dense.py);
       int4 = torch._weight_int4pack_mm (W4A16, group 128, gpt-fast's kernel); BF16 F.linear.
       "% floor": the NVFP4 weight bytes over the measured copy bandwidth, divided by the time.
       "q/k/v stacked": the rollout's attention input projections as one GEMM (each weight its own
       global scale, as rac.SharedInput runs them), against one stacked weight in the other formats.
    2. the decode layer's stages (the GEMM alone on a given operand; the quantizer alone), and each
       autotuning configuration forced in turn.
    3. expert layer decode (64, 128 and 256 tokens routed top-8 at random): quantize x, grouped
       gate/up (SwiGLU in its epilogue), quantize h, grouped down with the router weights; FP8 = the
       same steps in fp8.FP8Experts (gpu_kernels/w8a8_experts.py); BF16 = torch._grouped_mm.
       Floor: bytes of the experts hit. Also each grouped configuration forced in turn, and each
       GEMM alone.
    4. prefill (M = 4096), dense shapes.
    Timing: each op is captured in a CUDA graph and the replays are timed (do_bench, median): GPU
    time without Python launch gaps (a decode step runs as a graph). Each graph calls the op on
    enough copies of its weights (>= 180 MB in all, 3x the L2) that they come from HBM, as in a
    48-layer model.
    """
    import math

    import torch.nn.functional as F

    import fp8
    import moe
    import nvfp4
    import rac
    from gpu_kernels import gemm_common, w4a4_dense, w4a4_experts

    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    print(
        f"\ncopy bandwidth (read + write, 1 GiB): {copy_bw / 1e12:.2f} TB/s; "
        "times: median us per call, CUDA-graph replays, weights rotated through HBM\n"
    )
    bf16 = torch.bfloat16
    D, H_Q, H_KV, E, A, I = 2048, 4096, 512, 128, 8, 768
    # the config's intermediate_size: a dense MLP's hidden width (gate/up as one weight)
    I_DENSE = 6144
    rotate_bytes = 180e6

    def graph_us(calls):
        """GPU time per call of `calls` (one closure per weight copy), captured and replayed as one
        graph."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up (and autotune) outside the capture
                for _ in range(2):
                    for call in calls:
                        call()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for call in calls:
                    call()
            return bench_ms(graph.replay) * 1e3 / len(calls)
        except Exception as error:
            # one failing op must not take the other rows down: say so, print nan
            print(f"  (failed: {type(error).__name__}: {str(error).splitlines()[0][:160]})")
            return float("nan")

    def forced(kernel, bucket):
        """Each autotuning configuration of `bucket` forced on `kernel` in turn, as a label; the
        autotuner's own picks are restored afterwards (for the list printed at the end)."""
        configs, picks = list(kernel.configs), dict(kernel.cache)
        try:
            for c in configs:
                if c.kwargs["BUCKET"] != bucket:
                    continue
                kernel.configs = [c]
                kernel.cache.clear()
                yield _config_label(c, " ")
        finally:
            kernel.configs = configs
            kernel.cache.clear()
            kernel.cache.update(picks)

    def copies(nbytes):
        return max(1, min(64, math.ceil(rotate_bytes / nbytes)))

    def int4_weight(w):
        """torch's int4 weight-only format (group 128, asymmetric, as gpt-fast quantizes) for
        F.linear-shaped w."""
        N, K = w.shape
        groups = w.float().view(N, K // 128, 128)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-6)
        q = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).view(N, K)
        packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
        zero = low + 8 * scale  # the kernel computes (q - 8) * scale + zero
        scales_and_zeros = torch.stack((scale, zero), dim=-1).view(N, K // 128, 2)
        return packed, scales_and_zeros.transpose(0, 1).contiguous().to(bf16)

    def stacked_weight(w, splits):
        """The rollout's q/k/v: each weight quantized with its own global scale, stacked along N."""
        return rac.stack_weights([nvfp4.quantize_weight(part) for part in w.split(splits)])

    dense = []
    qkv_splits = (H_Q, H_KV, H_KV)
    for name, N, K in (
        ("q_proj", H_Q, D),
        ("k/v_proj", H_KV, D),
        ("o_proj", D, H_Q),
        ("q/k/v stacked", sum(qkv_splits), D),
        ("dense gate/up", 2 * I_DENSE, D),
        ("dense down", D, I_DENSE),
    ):
        w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
        splits = qkv_splits if name == "q/k/v stacked" else None
        w_q = stacked_weight(w, splits) if splits else nvfp4.quantize_weight(w)
        bytes_ = {"w4a4": N * K * (0.5 + 1 / 16), "fp8": N * K + 4 * N, "bf16": 2 * N * K}
        try:
            int4 = int4_weight(w)
        except Exception as error:
            print(
                f"  (int4 weight packing failed: {type(error).__name__}: "
                f"{str(error).splitlines()[0][:160]})"
            )
            int4 = None
        dense.append(
            (
                name,
                N,
                K,
                splits,
                bytes_,
                [w.clone() for _ in range(copies(bytes_["bf16"]))],
                [
                    tuple(t.clone() for t in fp8.quantize_weight(w))
                    for _ in range(copies(bytes_["fp8"]))
                ],
                [
                    nvfp4.NVFP4Tensor(
                        w_q.data.clone(), w_q.block_scale.clone(), w_q.global_scale.clone()
                    )
                    for _ in range(copies(bytes_["w4a4"]))
                ],
                [tuple(t.clone() for t in int4) for _ in range(copies(bytes_["w4a4"]))]
                if int4
                else [],
            )
        )

    def dense_times(M, variants=False):
        rows = []
        for name, N, K, splits, bytes_, ws, w8s, wqs, w4s in dense:

            def w4a4_layer(x, w, mask=None, splits=splits):
                return rac.nvfp4_linear_triton(x, w, mask, splits=splits)

            x = torch.randn(M, K, device="cuda", dtype=bf16)
            mask = torch.arange(K // 16, device="cuda") % 2 == 0
            int4_calls = [lambda w=w: torch._weight_int4pack_mm(x, w[0], 128, w[1]) for w in w4s]
            t = {
                "bf16": graph_us([lambda w=w: F.linear(x, w) for w in ws]),
                "fp8": graph_us([lambda w=w: fp8.linear(x, *w) for w in w8s]),
                "int4": graph_us(int4_calls) if w4s else float("nan"),
                "w4a4": graph_us([lambda w=w: w4a4_layer(x, w) for w in wqs]),
                "rac0.5": graph_us([lambda w=w: w4a4_layer(x, w, mask) for w in wqs]),
            }
            if variants:
                act = rac.quantize_activation_triton(x, mask)
                t["GEMM alone"] = graph_us(
                    [lambda w=w: rac.layer_matmul(act, w, bf16, splits) for w in wqs]
                )
                t["quantizer alone"] = graph_us(
                    [lambda: rac.quantize_activation_triton(x, mask)] * 20
                )
                bucket = gemm_common.m_bucket(M, w4a4_dense.DENSE_CONFIGS)
                t["configs"] = {
                    label: graph_us([lambda w=w: w4a4_layer(x, w, mask) for w in wqs])
                    for label in forced(w4a4_dense.dense_kernel, bucket)
                }
            rows.append((name, N, K, M, t, bytes_["w4a4"] / copy_bw * 1e6))
        return rows

    # ------------------------------------------------------------------ 1. dense decode
    print("### Dense projections, decode: the whole layer (activation quantization included)\n")
    print(
        "| layer (N x K) | M | BF16 | FP8 | int4 W4A16 | W4A4 | W4A4 RAC 0.5 | RAC 0.5 vs BF16 "
        "| vs int4 | vs FP8 | RAC cost | % floor |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    variant_rows = []
    for M in (1, 16, 64, 256):  # the rows of a decode step at batch 1 ... 256
        rows = dense_times(M, variants=True)
        variant_rows += rows
        for name, N, K, M, t, floor in rows:
            print(
                f"| {name} ({N}x{K}) | {M} | {t['bf16']:.1f} | {t['fp8']:.1f} | {t['int4']:.1f} | "
                f"{t['w4a4']:.1f} | {t['rac0.5']:.1f} | {t['bf16'] / t['rac0.5']:.2f}x | "
                f"{t['int4'] / t['rac0.5']:.2f}x | {t['fp8'] / t['rac0.5']:.2f}x | "
                f"{t['rac0.5'] / t['w4a4']:.2f}x | {100 * floor / t['rac0.5']:.0f}% |"
            )

    # ------------------------------------------------------------------ 2. variants
    print("\n### Decode layer variants, RAC 0.5 (us): what each stage costs\n")
    print(
        "| layer | M | layer (autotuned) | GEMM alone | quantizer alone | byte floor | "
        "configurations forced (BLOCK_M/N/K, split-K, warps, stages) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, N, K, M, t, floor in variant_rows:
        configs = "; ".join(f"{label}: {us:.1f}" for label, us in t["configs"].items())
        print(
            f"| {name} | {M} | {t['rac0.5']:.1f} | {t['GEMM alone']:.1f} | "
            f"{t['quantizer alone']:.1f} | {floor:.1f} | {configs} |"
        )

    # ------------------------------------------------------------------ 3. experts
    gate_up = torch.randn(E, 2 * I, D, device="cuda", dtype=bf16) * 0.02
    down = torch.randn(E, D, I, device="cuda", dtype=bf16) * 0.02
    fp8_experts = fp8.FP8Experts(E, D, I, device="cuda")
    fp8_experts.load_weights(gate_up, down)
    print(
        "\n### Expert layer, decode (128 experts, top-8; gate/up 2048 -> 2x768, SwiGLU, "
        "down 768 -> 2048)\n"
    )
    print(
        "| tokens | experts hit | BF16 | FP8 | W4A4 | W4A4 RAC 0.5 | vs BF16 | vs FP8 | % floor | "
        "GEMMs alone: gate/up, down | floor: gate/up, down "
        "| grouped configurations forced (layer time) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |")
    for T in (64, 128, 256):
        x = torch.randn(T, D, device="cuda", dtype=bf16)
        expert_ids = torch.rand(T, E, device="cuda").topk(A, dim=-1).indices
        weights = torch.softmax(torch.randn(T, A, device="cuda"), dim=-1)
        routing = moe.route_tokens(expert_ids, E)
        # (T * A,); the down GEMM reads them through routing.order
        expert_weights = weights.reshape(-1)
        x_sorted = x[routing.token_ids]
        hit = int((routing.counts > 0).sum())
        layer = rac.NVFP4Experts(E, D, I, device="cuda")
        layer.load_weights(gate_up, down)  # its ExpertWeights also time the GEMMs alone
        rac_layer = rac.NVFP4Experts(E, D, I, rac_ratio=0.5, device="cuda")
        rac_layer.load_state_dict(layer.state_dict(), strict=False)
        for selector in (rac_layer.rac_gate_up, rac_layer.rac_down):
            selector.mask.copy_(torch.arange(selector.n_blocks, device="cuda") % 2 == 0)
            selector.calibrated = True

        def bf16_layer():
            h = torch._grouped_mm(x_sorted, gate_up.transpose(-2, -1), offs=routing.offsets)
            g, u = h.chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=routing.offsets)

        def fp8_layer():
            return fp8_experts.sorted_rows(x, routing, expert_weights)

        act_x = rac.quantize_activation_triton(x)
        act_h = rac.quantize_activation_triton(torch.randn(T * A, I, device="cuda", dtype=bf16))
        t = {
            "bf16": graph_us([bf16_layer]),
            "fp8": graph_us([fp8_layer]),
            "w4a4": graph_us([lambda: layer._forward_triton(x, routing, expert_weights)]),
            "rac": graph_us([lambda: rac_layer._forward_triton(x, routing, expert_weights)]),
            "gate_up": graph_us(
                [
                    lambda: rac.grouped_matmul_triton(
                        act_x,
                        layer.gate_up_w,
                        routing.counts,
                        row_ids=routing.token_ids,
                        swiglu=True,
                        tokens=T,
                    )
                ]
            ),
            "down": graph_us(
                [
                    lambda: rac.grouped_matmul_triton(
                        act_h,
                        layer.down_w,
                        routing.counts,
                        row_weights=expert_weights,
                        row_weight_ids=routing.order,
                        tokens=T,
                    )
                ]
            ),
        }
        # the kernel the layer runs here
        if rac.backend(x.device) == "gluon" and T < rac.GLUON_EXPERTS_BELOW:
            from gpu_kernels import w4a4_experts_gluon

            kernel = w4a4_experts_gluon.grouped_gluon_kernel
            table = w4a4_experts_gluon.GLUON_CONFIGS
        else:
            kernel = w4a4_experts.grouped_kernel
            table = w4a4_experts.GROUPED_CONFIGS
        configs = "; ".join(
            f"{label}: {graph_us([lambda: layer._forward_triton(x, routing, expert_weights)]):.1f}"
            for label in forced(kernel, gemm_common.m_bucket(-(-T * A // E), table))
        )
        floor = {
            k: hit * n * (0.5 + 1 / 16) / copy_bw * 1e6
            for k, n in (("gate_up", 2 * I * D), ("down", D * I))
        }
        total = floor["gate_up"] + floor["down"]
        print(
            f"| {T} | {hit} | {t['bf16']:.1f} | {t['fp8']:.1f} | {t['w4a4']:.1f} | "
            f"{t['rac']:.1f} | {t['bf16'] / t['rac']:.2f}x | {t['fp8'] / t['rac']:.2f}x | "
            f"{100 * total / t['rac']:.0f}% | "
            f"{t['gate_up']:.1f}, {t['down']:.1f} | {floor['gate_up']:.1f}, {floor['down']:.1f} | "
            f"{configs} |"
        )
    del gate_up, down, fp8_experts

    # ------------------------------------------------------------------ 4. prefill
    print(
        "\n### Dense projections, prefill (M = 4096; the W4A4 GEMM decodes the weight once, "
        "to fp16 planes; one weight copy: at this size the GEMM, not the weight read, "
        "sets the time)\n"
    )
    print(
        "| layer (N x K) | BF16 | FP8 | W4A4 | W4A4 RAC 0.5 | W4A4 / BF16 time | W4A4 TFLOP/s | "
        "BF16 TFLOP/s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    dense = [
        (name, N, K, splits, b, ws[:1], w8s[:1], wqs[:1], w4s[:1])
        for name, N, K, splits, b, ws, w8s, wqs, w4s in dense
    ]
    for name, N, K, M, t, _ in dense_times(4096):
        flops = 2 * M * N * K
        print(
            f"| {name} ({N}x{K}) | {t['bf16']:.1f} | {t['fp8']:.1f} | {t['w4a4']:.1f} | "
            f"{t['rac0.5']:.1f} | {t['w4a4'] / t['bf16']:.2f}x | {flops / t['w4a4'] / 1e6:.0f} | "
            f"{flops / t['bf16'] / 1e6:.0f} |"
        )

    _print_autotuned()


def _config_label(config, sep):
    """A W4A4 kernel configuration in words: BLOCK_M/N/K, split-K, warps, stages, and the optional
    fields."""
    kw = config.kwargs
    if "BLOCK_T" in kw:  # the experts' Gluon kernel: rows of a tile, output columns, K step, warps
        return sep.join(
            [f"{kw['BLOCK_T']}/{kw['BLOCK_N']}/{kw['BLOCK_K']}", f"{config.num_warps}w"]
        )
    parts = [
        f"{kw['BLOCK_M']}/{kw['BLOCK_N']}/{kw['BLOCK_K']}",
        f"split-K {kw.get('SPLIT_K', 1)}",
        f"{config.num_warps}w",
        f"{config.num_stages}s",
    ]
    if kw.get("X_FIRST"):
        parts.append("x-first")
    if config.maxnreg:
        parts.append(f"maxnreg {config.maxnreg}")
    return sep.join(parts)


def _print_autotuned():
    """The configurations the W4A4 and W8A8 kernels' autotuner chose in this process, per key (shape
    bucket, N, K, ...)."""
    from gpu_kernels import w4a4_dense, w4a4_experts, w8a8_dense, w8a8_experts

    try:
        from gpu_kernels.w4a4_experts_gluon import grouped_gluon_kernel

        gluon = (grouped_gluon_kernel,)
    except ImportError:  # Triton without Gluon
        gluon = ()
    fields = "BLOCK_M/N/K, split-K, warps, stages; Gluon: BLOCK_T/N/K, warps"
    print(f"\nautotuned configs (key -> {fields}):")
    for kernel in (
        w4a4_dense.dense_kernel,
        w4a4_experts.grouped_kernel,
        *gluon,
        w8a8_dense.dense_kernel,
        w8a8_experts.grouped_kernel,
    ):
        for key, config in kernel.cache.items():
            print(f"  {kernel.fn.fn.__name__} {key[:5]} -> {_config_label(config, ', ')}")


# ---------------------------------------------------------------------------- qat (qat.py)
def bench_qat(args):
    """Training step time (forward + backward + AdamW step) of moe.py's "small" preset, BF16
    weights, under each trainer mode (qat.py, symmetric.py): bf16 (the reference), qat
    (fake-quantized weights, recomputed every step), w4a4 (weights and activations
    fake-quantized), moeresq (w4a4 + residual
    compensation on half the blocks of every layer input), trace (w4a4 + rollout-guided rounding,
    with recorded codes for every token and every (token, expert) pair: its upper bound). Loss:
    cross-entropy on random tokens. One more row times the weight fake quantization alone
    (every QAT weight once), the part of qat's step that is not in bf16's.
    """
    import copy

    import torch.nn.functional as F

    import moe
    import nvfp4
    import qat
    import rac
    import symmetric

    preset, batch, seq_len = "small", 32, 256
    config = moe.MoEConfig.from_preset(preset)
    torch.manual_seed(0)
    base = moe.MoETransformer(config).cuda().bfloat16()
    tokens = torch.randint(config.vocab_size, (batch, seq_len + 1), device="cuda")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        _, routes = base(inputs, return_routes=True)  # (L, B, T, A)
    positions = torch.arange(batch * seq_len, device="cuda")

    def random_codes(keys, K):  # what a rollout would have recorded for these rows (random codes)
        n = keys.numel()
        q = nvfp4.quantize(torch.randn(n, K, device="cuda", dtype=torch.bfloat16))
        return rac.RecordedCodes(
            keys, q.data, q.block_scale, torch.full((n,), float(q.global_scale), device="cuda")
        )

    # what a rollout would hand the trainer: half the blocks, random codes
    def rollout_share(model, mode):
        layer_index = {id(b.mlp.experts): i for i, b in enumerate(model.layers)}
        masks, codes = {}, {}
        for path, layer in model.named_modules():
            if isinstance(layer, qat.QATLinear):
                G = layer.in_features // 16
                masks[path] = (torch.arange(G, device="cuda") < G // 2,)
                codes[path] = (
                    (random_codes(positions, layer.in_features),) if mode == "trace" else None
                )
            elif isinstance(layer, qat.QATExperts):
                D, I = layer.gate_up_proj.shape[-1], layer.down_proj.shape[-1]
                masks[path] = (
                    torch.arange(D // 16, device="cuda") < D // 32,
                    torch.arange(I // 16, device="cuda") < I // 32,
                )
                if mode == "trace":
                    # (B * T, A)
                    experts = routes[layer_index[id(layer)]].reshape(-1, config.n_active)
                    pair_keys = positions[:, None] * layer.n_experts + experts
                    down_keys = pair_keys.flatten().sort().values
                    codes[path] = (random_codes(positions, D), random_codes(down_keys, I))
        if mode == "moeresq":
            return symmetric.RolloutShare(masks=masks)
        if mode == "trace":
            return symmetric.RolloutShare(codes=codes)
        return None

    rows = []
    for mode in ("bf16", "qat", "w4a4", "moeresq", "trace"):
        model = copy.deepcopy(base)
        if mode == "qat":
            qat.convert_for_training(model)
        elif mode != "bf16":
            symmetric.convert_for_training(model, mode)
        share = rollout_share(model, mode)
        hand_offs = None
        if share is not None:
            hand_offs = share.hand_offs(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def train_step():
            logits = model(inputs, hand_offs=hand_offs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        ms = bench_ms(train_step, warmup=500, rep=3000)  # do_bench budgets are in ms: tens of steps
        rows.append((mode, ms))
        if mode == "qat":
            layers = [m for m in model.modules() if isinstance(m, (qat.QATLinear, qat.QATExperts))]
            weights_ms = bench_ms(lambda: [qat.quantized_weights(m) for m in layers])
            rows.append(("qat: weight fake quantization alone", weights_ms))
        del model, optimizer
        torch.cuda.empty_cache()

    n_params = sum(p.numel() for p in base.parameters())
    print(
        f"\nTraining step (fwd + bwd + AdamW), preset {preset!r} ({n_params / 1e6:.0f}M params, "
        f"vocab {config.vocab_size}, BF16 weights), "
        f"batch {batch} x {seq_len} tokens, median of CUDA-event timings\n"
    )
    print("| mode | step (ms) | tokens/s | vs bf16 |")
    print("| --- | ---: | ---: | ---: |")
    for label, ms in rows:
        tokens_per_s = batch * seq_len / (ms * 1e-3)
        print(f"| {label} | {ms:.2f} | {tokens_per_s:,.0f} | {ms / rows[0][1]:.2f}x |")


# ---------------------------------------------------------------------------- rollout (rollout.py)
def bench_rollout(args):
    """(a) rollout.generate against Hugging Face `generate` on one checkpoint; (b) decode tokens/s
    per precision.

    (a) A random "small"-preset Qwen3-MoE (vocab 32768) is built with transformers, saved with
        save_pretrained, and loaded by both sides (moe.load_hf / from_pretrained), BF16. 16 prompts
        of 32..63 random tokens x 16 samples = 256 sequences x 128 new tokens, temperature 1, no
        top-k/top-p, no EOS (every row makes all 128 tokens). HF samples with
        num_return_sequences=16 (each prompt prefilled 16 times, its default dynamic cache, its
        default attention and experts implementations). Time: whole call, prefill included, median
        of 3 after one warm-up (ours captures its CUDA graph in the warm-up).
    (b) Qwen3-30B-A3B layer shapes (D 2048, 32/4 heads of 128, 128 experts of 768, top-8), 4 layers,
        vocab 32768, random weights, converted by rac.convert_for_rollout. Decode
        rate = B * 128 / (t(144 new tokens) - t(16 new tokens)): the difference cancels prefill and
        per-call costs. B prompts of 64 tokens, 1 sample each, temperature 1, no EOS; context
        80..208 tokens.
    """
    _bench_rollout_vs_hf()
    try:
        import rac
    except ImportError as error:  # rac.py not written or not importable: part (b) needs it
        print(f"\nskipping decode tokens/s per precision: rac.py is not importable ({error})")
        return
    _bench_decode_per_precision(rac)


def _time_generate(model, prompts, num_samples, max_new_tokens, repeats=3, statistic="median"):
    """Wall seconds of rollout.generate over `repeats` calls after a warm-up (their median, or their
    minimum: the least disturbed call), and the last Rollout."""
    import statistics
    import time
    import rollout

    # warm-up: the pool, the graph capture
    out = rollout.generate(model, prompts, num_samples, max_new_tokens, seed=0)
    times = []
    for seed in range(1, repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = rollout.generate(model, prompts, num_samples, max_new_tokens, seed=seed)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return (min(times) if statistic == "min" else statistics.median(times)), out


def _graph_step_ms(model, max_new_tokens, rounds=5):
    """ms per decode step of the model's most recently used pooled decode state (the generate call
    just made): its CUDA graph replayed max_new_tokens - 1 times from the prompt's end (the cache's
    own capacity), timed with CUDA events; the fastest of `rounds`. The generate calls' wall time
    also holds the eager prefill, whose time on the H200 jumps between two levels about 25 ms apart
    at batch 256 from call to call: a rate taken as a difference of two calls moved by 10-20% with
    it."""
    import rollout

    state = rollout.last_decode_state(model)
    times = []
    for _ in range(rounds):
        state.cache.length.fill_(state.prompt_width)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(max_new_tokens - 1):
            state.graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (max_new_tokens - 1))
    return min(times)


def _bench_rollout_vs_hf(n_prompts=16, num_samples=16, max_new_tokens=128, vocab_size=32768):
    import statistics
    import tempfile
    import time
    import transformers
    import moe
    import rollout

    c = moe.MoEConfig.from_preset("small", vocab_size=vocab_size)
    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=4 * c.dim,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        num_experts=c.n_experts,
        num_experts_per_tok=c.n_active,
        moe_intermediate_size=c.expert_dim,
        max_position_embeddings=c.max_seq_len,
        norm_topk_prob=c.norm_topk_prob,
        rms_norm_eps=c.rms_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_embeddings,
    )
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        transformers.Qwen3MoeForCausalLM(hf_config).save_pretrained(directory)
        model, _ = moe.load_hf(directory, dtype=torch.bfloat16)
        hf = transformers.Qwen3MoeForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    model, hf = model.cuda().eval(), hf.cuda().eval()
    hf.generation_config.eos_token_id = None

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(32, 64, (n_prompts,), generator=generator).tolist()
    prompts = [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in lengths]
    width = max(lengths)
    input_ids = torch.zeros(n_prompts, width, dtype=torch.int64)
    attention_mask = torch.zeros(n_prompts, width, dtype=torch.int64)
    for p, prompt in enumerate(prompts):  # left padding, as HF expects for decoder-only generation
        input_ids[p, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[p, width - len(prompt) :] = 1
    input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()

    def hf_generate():
        return hf.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            num_return_sequences=num_samples,
            pad_token_id=0,
        )

    with torch.no_grad():
        out = hf_generate()  # warm-up
        assert out.shape == (n_prompts * num_samples, width + max_new_tokens), out.shape
        hf_times = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            hf_generate()
            torch.cuda.synchronize()
            hf_times.append(time.perf_counter() - start)
    hf_seconds = statistics.median(hf_times)
    ours_seconds, ours = _time_generate(model, prompts, num_samples, max_new_tokens)
    assert ours.completion_ids.shape == (n_prompts * num_samples, max_new_tokens)

    # Same checkpoint, same numbers: greedy continuations of the first prompts agree (BF16 rounding
    # may flip a near-tie late in a row, so this is reported, not asserted).
    check = 16
    greedy = rollout.generate(model, prompts[:4], 1, check, temperature=0.0)
    with torch.no_grad():
        hf_greedy = hf.generate(
            input_ids=input_ids[:4],
            attention_mask=attention_mask[:4],
            do_sample=False,
            max_new_tokens=check,
            min_new_tokens=check,
            pad_token_id=0,
        )[:, width:]
    agreement = (greedy.completion_ids == hf_greedy).float().mean().item()

    tokens = n_prompts * num_samples * max_new_tokens
    print(
        f"\n### rollout: {n_prompts} prompts x {num_samples} samples x {max_new_tokens} new "
        f'tokens, BF16, "small" preset (D {c.dim}, {c.n_layers} layers, {c.n_experts} experts '
        f"top-{c.n_active}, vocab {vocab_size}), prompts of 32..63 tokens, temperature 1, no EOS"
    )
    print(
        f"HF: transformers {transformers.__version__}, attention {hf.config._attn_implementation}, "
        f"experts {getattr(hf.config, '_experts_implementation', 'n/a')}, dynamic cache; "
        f"greedy tokens equal to ours on 4 prompts x {check} tokens: {100 * agreement:.0f}%"
    )
    print("| sampler | time (s) | tokens/s | vs HF generate |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| HF transformers generate | {hf_seconds:.2f} | {tokens / hf_seconds:,.0f} | 1.00x |")
    graph = "CUDA graph" if ours.used_cuda_graph else "eager"
    print(
        f"| rollout.generate ({graph}) | {ours_seconds:.2f} | {tokens / ours_seconds:,.0f} | "
        f"{hf_seconds / ours_seconds:.2f}x (target >= 5x) |"
    )
    del model, hf
    torch.cuda.empty_cache()


# (name, rollout mode, RAC ratio[, activation scale])
DECODE_VARIANTS = [
    ("moe.py BF16 (not converted)", None, 0.0),
    ("rac bf16", "bf16", 0.0),
    ("rac fp8", "fp8", 0.0),
    ("rac nvfp4", "nvfp4", 0.0),
    ("rac nvfp4, row scales", "nvfp4", 0.0, "row"),
    ("rac nvfp4 + RAC 0.5", "nvfp4", 0.5),
    ("rac w4a16", "w4a16", 0.0),
]
DECODE_CHECKS = [
    ("rac nvfp4 / rac fp8", "rac nvfp4", "rac fp8", 1.3),
    ("rac nvfp4 / rac bf16", "rac nvfp4", "rac bf16", 1.6),
    ("rac nvfp4 + RAC 0.5 / rac nvfp4", "rac nvfp4 + RAC 0.5", "rac nvfp4", 0.95),
    ("rac nvfp4, row scales / rac nvfp4", "rac nvfp4, row scales", "rac nvfp4", 0.97),
    ("rac w4a16 / rac nvfp4", "rac w4a16", "rac nvfp4", 1.0),
    ("rac fp8 / rac bf16", "rac fp8", "rac bf16", 1.3),
]


def bench_racsweep(args):
    """Decode tokens/s of the NVFP4 rollout at each RAC ratio of the study's sweep (0, 0.125, 0.25,
    0.5, 0.75, 1), on the layer shapes and method of `bench.py rollout` (b). Ratio 1 compensates
    every block."""
    import rac

    ratios = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)
    variants = [("rac bf16", "bf16", 0.0)] + [
        (f"rac nvfp4 + RAC {r:g}", "nvfp4", r) for r in ratios
    ]
    checks = [
        (f"RAC {r:g} / RAC 0", f"rac nvfp4 + RAC {r:g}", "rac nvfp4 + RAC 0", 1 / 1.15)
        for r in ratios[1:]
    ]
    _bench_decode_per_precision(rac, variants=variants, checks=checks)


def _bench_decode_per_precision(
    rac,
    batches=(64, 256),
    prompt_len=64,
    short=16,
    long=144,
    vocab_size=32768,
    variants=DECODE_VARIANTS,
    checks=DECODE_CHECKS,
):
    import copy
    import moe
    import rollout

    config = moe.MoEConfig.from_preset(
        "qwen3-30b-a3b", n_layers=4, vocab_size=vocab_size, max_seq_len=1024
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = moe.MoETransformer(config).to(torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, vocab_size, (max(batches), prompt_len), generator=generator).tolist()

    rates = {}  # (name, batch) -> decode tokens/s
    rows = []
    for name, mode, rac_ratio, *act_scale in variants:
        model = copy.deepcopy(base)
        try:
            if mode is not None:
                rac.convert_for_rollout(
                    model, mode, rac_ratio=rac_ratio, act_scale=(act_scale or ["tensor"])[0]
                )
            for batch in batches:
                # end to end (the side column): the fastest of five calls per length, as a disturbed
                # call moves a difference of two times by several %; the rate itself is timed from
                # the decode graph's replays, which hold no prefill
                t_short, _ = _time_generate(
                    model, prompts[:batch], 1, short, repeats=5, statistic="min"
                )
                t_long, out = _time_generate(
                    model, prompts[:batch], 1, long, repeats=5, statistic="min"
                )
                end_to_end = batch * (long - short) / (t_long - t_short)
                step_ms = _graph_step_ms(model, long) if out.used_cuda_graph else None
                rates[name, batch] = batch * 1e3 / step_ms if step_ms else end_to_end
                rows.append(
                    (name, batch, step_ms, rates[name, batch], end_to_end, out.used_cuda_graph)
                )
        except Exception as error:  # report the failing variant and keep measuring the others
            rows.append((name, None, None, None, None, f"failed: {type(error).__name__}: {error}"))
        rollout.free_decode_states(model)
        del model
        torch.cuda.empty_cache()

    print(
        f"\n### decode tokens/s per precision: Qwen3-30B-A3B layer shapes, "
        f"{config.n_layers} layers, vocab {vocab_size}, random weights; prompts of {prompt_len} "
        f"tokens, 1 sample each. ms / decode step: the captured step's graph replayed {long - 1} "
        f"times after a generate call, fastest of 5 rounds; "
        f"tokens/s = B / that (the ratios below use it); end to end: B * {long - short} / "
        f"(t({long} new) - t({short} new)), each t the fastest of 5 generate calls"
    )
    print(
        "| rollout layers | batch | ms / decode step | decode tokens/s | end to end tokens/s | "
        "CUDA graph |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, batch, step_ms, rate, end_to_end, graph in rows:
        if batch is None:
            print(f"| {name} | - | - | - | - | {graph} |")
        else:
            step = f"{step_ms:.3f}" if step_ms else "-"
            print(
                f"| {name} | {batch} | {step} | {rate:,.0f} | {end_to_end:,.0f} | "
                f"{'yes' if graph else 'no (eager)'} |"
            )

    for b in batches:
        print(f"\n| speed ratio at batch {b} | measured | target |")
        print("| --- | ---: | ---: |")
        for label, fast, slow, target in checks:
            if (fast, b) in rates and (slow, b) in rates:
                ratio = rates[fast, b] / rates[slow, b]
                print(
                    f"| {label} | {ratio:.2f}x | >= {target:.2f}x "
                    f"{'(met)' if ratio >= target else '(NOT met)'} |"
                )
            else:
                print(f"| {label} | not measured | >= {target:.2f}x |")


def bench_decode(args):
    """Part (b) of `rollout` alone: decode tokens/s per precision on Qwen3-30B-A3B layer shapes, and
    the W4A4 kernels' autotuned configurations (shared by every variant in the process: the first to
    meet a key tunes it)."""
    import rac

    _bench_decode_per_precision(rac)
    _print_autotuned()


def bench_prefill(args, batch=4, length=1024, rounds=5, replays=10):
    """A prefill per precision: the forward of 4 Qwen3-30B-A3B layers on batch x length tokens,
    captured as a CUDA graph (no launch or allocator noise), replayed `replays` times per round,
    rounds interleaved across precisions (clock drift hits each alike); the median round and the
    spread."""
    import copy
    import statistics
    import moe
    import rac

    config = moe.MoEConfig.from_preset(
        "qwen3-30b-a3b", n_layers=4, vocab_size=32768, max_seq_len=length
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = moe.MoETransformer(config).to(torch.bfloat16).eval()
    tokens = torch.randint(1, config.vocab_size, (batch, length), device="cuda")
    graphs = {}
    for name, mode, rac_ratio, *act_scale in DECODE_VARIANTS[1:]:
        model = rac.convert_for_rollout(
            copy.deepcopy(base), mode, rac_ratio=rac_ratio, act_scale=(act_scale or ["tensor"])[0]
        )
        with torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            # warm-up: autotuning, RAC's first-input selection, workspaces
            with torch.cuda.stream(stream):
                for _ in range(3):
                    model(tokens)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model(tokens)
        graphs[name] = (graph, model)
    times = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, (graph, _) in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graph.replay()
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / replays)
    print(
        f"\n### prefill: one forward of {config.n_layers} Qwen3-30B-A3B layers on "
        f"{batch} x {length} tokens (vocab {config.vocab_size}, random weights), CUDA graph; "
        f"ms per forward, median of {rounds} interleaved rounds of {replays} replays (min - max)"
    )
    print("| rollout layers | ms / prefill | rounds min - max | vs rac bf16 |")
    print("| --- | ---: | --- | ---: |")
    bf16 = statistics.median(times["rac bf16"])
    for name, t in times.items():
        median = statistics.median(t)
        print(f"| {name} | {median:.3f} | {min(t):.3f} - {max(t):.3f} | {bf16 / median:.2f}x |")


COMMANDS = {
    "quantize": bench_quantize,
    "model": bench_model,
    "gemm": bench_gemm,
    "qat": bench_qat,
    "rollout": bench_rollout,
    "decode": bench_decode,
    "racsweep": bench_racsweep,
    "prefill": bench_prefill,
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=list(COMMANDS), nargs="+")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.py measures GPU speed and needs CUDA; none is available here.")
    print(gpu_header())
    for name in args.what:
        COMMANDS[name](args)
