"""gpu_kernels/w4a4_experts_gluon.py: the experts' grouped GEMM in Gluon (sm_89 / sm_90). Its
autotuner's K steps; compiled for sm_90 on the CPU (8-byte code loads into mma.sync), with one x
scale and one per row; on the GPU against rac.grouped_matmul_reference on short tiles and at every
bucket, every configuration forced in turn, with per-row x scales (against the reference, bit for
bit the one-scale results where equal, a token's output independent of its batch) and the W4A16
operand."""

import pytest
import torch
from test_kernels_w4a4_dense import assert_rows_close, deterministic_and_close, forced_configs
from test_kernels_w4a4_experts import (
    assert_batch_invariant,
    expert_layer,
    routing_with_empty_experts,
)
from test_kernels_w4a4_quantize import COMPILE_PREAMBLE, compiled_output, rows_of_many_magnitudes

import moe
import nvfp4
import rac

pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import gemm_common, w4a4_experts_gluon  # noqa: E402


def _gluon_here():
    return torch.cuda.is_available() and rac.backend(torch.device("cuda")) == "gluon"


def grouped(act, w, counts, **kwargs):
    return w4a4_experts_gluon.grouped_matmul(
        act.operand,
        act.global_scale,
        w.data,
        w.block_scale,
        w.global_scale,
        counts,
        torch.float32,
        **kwargs,
    )


def test_gluon_autotuner_keeps_the_bucket_and_steps_k_within_one_chunk_of_the_layout():
    # a K step may not cross a chunk of ExpertWeights' layout: K = 192 is one chunk
    # (not a multiple of 128), which 128-element steps do not divide, so they become 64; at K = 2048
    # (chunks of 128) they stay
    configs = w4a4_experts_gluon.grouped_gluon_kernel.configs
    for chunk, expected in ((128, {128, 64}), (192, {64})):
        for bucket, entries in w4a4_experts_gluon.GLUON_CONFIGS.items():
            kept = w4a4_experts_gluon.gluon_prune(configs, {"M_BUCKET": bucket}, CHUNK=chunk)
            shapes = [(c.kwargs["BLOCK_T"], c.kwargs["BLOCK_N"], c.num_warps) for c in kept]
            assert shapes == [(t, n, w) for t, n, _, w in entries]
            assert all(c.kwargs["BUCKET"] == bucket for c in kept)
            for c, (_, _, k, _) in zip(kept, entries):
                step = c.kwargs["BLOCK_K"]
                assert step == (k if chunk % k == 0 else 64) and step in expected


_COMPILE_GLUON_FOR_SM90 = (
    COMPILE_PREAMBLE
    + r"""
import itertools
from triton.experimental.gluon._runtime import GluonASTSource
from gpu_kernels import w4a4_experts_gluon
kernel = jit(w4a4_experts_gluon.grouped_gluon_kernel)
types = ["*fp16", "*fp32", "*i64", "*fp32", "*i64", "*u8", "*u8", "*fp32", "*i64", "*bf16"]
types += [i] * 13
for (swiglu, tile, n, k), row_scale in itertools.product(
        ((1, 8, 64, 128), (1, 32, 64, 64), (0, 8, 128, 128), (0, 64, 64, 64)), (0, 1)):
    swiglu = bool(swiglu)
    c = dict(GATHER=swiglu, ROW_WEIGHTS=not swiglu, WEIGHT_IDS=not swiglu, SWIGLU=swiglu,
             ROW_SCALE=bool(row_scale), E_POW2=128, CHUNK=128, BUCKET=8, BLOCK_T=tile, BLOCK_N=n,
             BLOCK_K=k, NUM_WARPS=4)
    signature = dict(zip([a for a in kernel.arg_names if a not in c], types))
    signature.update({a: "constexpr" for a in c})
    aligned = [a for a in kernel.arg_names if a not in c  # 16-divisible, as the launches see them
               and (signature[a].startswith("*") or a.startswith(("stride", "N", "K", "x_plane")))]
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    ptx = compile(GluonASTSource(kernel, signature, c, attrs), target=GPUTarget("cuda", 90, 32),
                  options=dict(num_warps=4)).asm["ptx"]
    mma = len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16", ptx))
    loads8 = len(re.findall(r"ld\.global(?:\.\w+)*\.v2\.b32", ptx))
    loads1 = len(re.findall(r"ld\.global(?:\.\w+)*\.[us]8", ptx))
    print(int(swiglu), tile, n, k, row_scale, mma, loads8, loads1, int("cp.async" in ptx))
"""
)


def test_a_weight_whose_k_is_not_a_multiple_of_64_is_refused_before_any_launch():
    # the kernel has no K masks: K = 80 would read past every row (on the GPU: garbage, or a fault)
    w = rac.chunk_experts(nvfp4.quantize_weight(torch.randn(2, 32, 80)))
    with pytest.raises(ValueError, match="the weight's K must be a multiple of 64, got 80"):
        w4a4_experts_gluon.grouped_matmul(
            torch.zeros(2, 3, 40, dtype=torch.float16),
            torch.ones(()),
            w.data,
            w.block_scale,
            w.global_scale,
            torch.tensor([3, 0]),
            torch.float32,
        )


def test_gluon_kernel_loads_8_byte_code_runs_into_mma_sync_on_hopper():
    # compiled for sm_90 on the CPU (numerics: the GPU tests). Per K step a thread loads each of its
    # weight rows' 8 codes bytes (one NVFP4 block) as one 8-byte load and its block scale as one
    # byte, with no shared memory staging. A tile of 16 rows or more also holds the loop of a tile
    # of half its rows (for tiles at most half full), one of 32 or more that of half plus a quarter
    # (at most three quarters full): its MMAs a K step are 1.5 and 2.25 times a full tile's, which
    # are (weight rows / 16 a warp) x (tile rows / 8) x (BLOCK_K / 16). The same with each row's own
    # x scale (read in the epilogue only).
    lines = compiled_output(_COMPILE_GLUON_FOR_SM90)
    assert sorted(int(line.split()[4]) for line in lines) == [0] * 4 + [1] * 4, lines
    for line in lines:
        swiglu, tile, n, k, _, mma, loads8, loads1, staged = map(int, line.split())
        full = (n * (2 if swiglu else 1) // 16 // 4) * (tile // 8) * (k // 16)
        assert mma == full * {8: 4, 16: 6, 32: 9, 64: 9}[tile] // 4 and not staged, line
        assert loads8 > 0 and loads8 >= loads1, line  # codes in 8-byte runs, scales a byte each


@pytest.mark.cuda
def test_gluon_kernel_matches_the_reference_on_short_tiles_in_every_config():
    # each configuration of the Gluon kernel meets short row tiles (14 to 24 rows an expert, three
    # empty experts) and a short last N tile (gate/up 80 columns, down 208), whose masked rows must
    # neither be stored nor spoil the stored ones
    if not _gluon_here():
        pytest.skip("the Gluon experts kernel runs on sm_89 and sm_90 only")
    torch.manual_seed(0)
    E, D, I, N_DOWN, tokens, A = 8, 256, 80, 208, 48, 2
    _, routing = routing_with_empty_experts(E, tokens, A, "cuda")
    x = rac.quantize_activation_triton(
        torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16),
        torch.arange(D // 16, device="cuda") % 2 == 0,
        codes=True,
    )
    h = rac.quantize_activation_triton(
        torch.randn(tokens * A, 128, device="cuda", dtype=torch.bfloat16), codes=True
    )
    gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda"))
    down_q = nvfp4.quantize_weight(torch.randn(E, N_DOWN, 128, device="cuda"))
    gate_up_w, down_w = rac.chunk_experts(gate_up_q), rac.chunk_experts(down_q)
    row_weights = torch.rand(tokens * A, device="cuda")
    references = (
        rac.grouped_matmul_reference(
            x.x_q,
            gate_up_q,
            routing.counts,
            x.residual,
            row_ids=routing.token_ids,
            swiglu=True,
            out_dtype=torch.float32,
        ),
        rac.grouped_matmul_reference(
            h.x_q, down_q, routing.counts, row_weights=row_weights, out_dtype=torch.float32
        ),
    )
    bucket = gemm_common.m_bucket(-(-tokens * A // E), w4a4_experts_gluon.GLUON_CONFIGS)
    failures = []
    for config in forced_configs(w4a4_experts_gluon.grouped_gluon_kernel, bucket):
        outputs = (
            grouped(x, gate_up_w, routing.counts, row_ids=routing.token_ids, swiglu=True),
            grouped(h, down_w, routing.counts, row_weights=row_weights),
        )
        for name, y, reference in zip(("gate/up", "down"), outputs, references):
            error = ((y - reference).abs().max() / reference.abs().max()).item()
            if not error <= 2e-3:  # NaN fails too
                failures.append(f"{name} {config}: relative error {error:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.cuda
def test_every_gpu_config_is_deterministic_and_matches_the_reference():
    # each configuration forced and repeated at each of the kernel's buckets (4, 8, 16, 64 rows an
    # expert) and at a prefill of 512 evaluation prompts, 26k tokens, on the small preset's shapes
    import triton

    if not _gluon_here():
        pytest.skip("the Gluon experts kernel runs on sm_89 and sm_90 only")
    torch.manual_seed(0)
    E, D, I, A = 32, 512, 256, 4
    gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda") * 0.05)
    down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda") * 0.05)
    gate_up_w, down_w = rac.chunk_experts(gate_up_q), rac.chunk_experts(down_q)
    kernel, calls = w4a4_experts_gluon.grouped_gluon_kernel, {}
    for tokens in (32, 64, 128, 512, 26112):
        routing = moe.route_tokens(torch.rand(tokens, E, device="cuda").topk(A, dim=-1).indices, E)
        x = rac.quantize_activation_triton(
            torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16), codes=True
        )
        h = rac.quantize_activation_triton(
            torch.randn(tokens * A, I, device="cuda", dtype=torch.bfloat16), codes=True
        )
        row_weights = torch.rand(tokens * A, device="cuda")
        bucket = gemm_common.m_bucket(triton.cdiv(tokens * A, E), w4a4_experts_gluon.GLUON_CONFIGS)
        calls[f"gate/up T={tokens}"] = (
            kernel,
            bucket,
            lambda c: False,
            lambda x=x, routing=routing: grouped(
                x, gate_up_w, routing.counts, row_ids=routing.token_ids, swiglu=True
            ),
            rac.grouped_matmul_reference(
                x.x_q,
                gate_up_q,
                routing.counts,
                row_ids=routing.token_ids,
                swiglu=True,
                out_dtype=torch.float32,
            ),
        )
        # with a scale per row (rows 10x apart either way), gathered at gate/up
        if tokens in (64, 512):
            x_rows = (
                torch.randn(tokens, D, device="cuda")
                * torch.logspace(-1, 1, tokens, device="cuda")[:, None]
            ).bfloat16()
            x_row = rac.quantize_activation_triton(x_rows, act_scale="row")
            calls[f"gate/up row scales T={tokens}"] = (
                kernel,
                bucket,
                lambda c: False,
                lambda x_row=x_row, routing=routing: grouped(
                    x_row, gate_up_w, routing.counts, row_ids=routing.token_ids, swiglu=True
                ),
                rac.grouped_matmul_reference(
                    nvfp4.quantize_activation(x_rows, None, "row")[0],
                    gate_up_q,
                    routing.counts,
                    row_ids=routing.token_ids,
                    swiglu=True,
                    out_dtype=torch.float32,
                ),
            )
        calls[f"down T={tokens}"] = (
            kernel,
            bucket,
            lambda c: False,
            lambda h=h, routing=routing, row_weights=row_weights: grouped(
                h, down_w, routing.counts, row_weights=row_weights
            ),
            rac.grouped_matmul_reference(
                h.x_q, down_q, routing.counts, row_weights=row_weights, out_dtype=torch.float32
            ),
        )
    failures = deterministic_and_close(calls)
    assert not failures, "\n".join(failures)


def _gluon_layer(gate_up_w, down_w, mask=None, act_scale="row", quantize=True):
    return expert_layer(grouped, gate_up_w, down_w, mask, act_scale, quantize)


@pytest.mark.cuda
def test_gluon_kernel_with_row_scales_and_the_w4a16_operand_matches_the_references():
    # short tiles (14 to 24 rows an expert) and token rows 10^-6 .. 10^6 apart, every configuration
    # forced: gate/up reads the gathered row's scale, down the sorted row's; row scales equal to the
    # tensor's give its bits; the W4A16 operand gives x @ DQ(W).T to fp32 order. (I = 128: down's K,
    # a multiple of 64.)
    if not _gluon_here():
        pytest.skip("the Gluon experts kernel runs on sm_89 and sm_90 only")
    E, D, I, tokens, A = 8, 256, 128, 48, 2
    expert_ids, routing = routing_with_empty_experts(E, tokens, A, "cuda")
    generator = torch.Generator().manual_seed(0)
    gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, generator=generator).cuda())
    down_q = nvfp4.quantize_weight(torch.randn(E, D, I, generator=generator).cuda())
    gate_up_w, down_w = rac.chunk_experts(gate_up_q), rac.chunk_experts(down_q)
    x = rows_of_many_magnitudes(tokens, D, 0).cuda()
    mask = torch.arange(D // 16, device="cuda") % 2 == 0
    router_weights = torch.rand(tokens * A, device="cuda")
    bucket = gemm_common.m_bucket(-(-tokens * A // E), w4a4_experts_gluon.GLUON_CONFIGS)
    tensor_act = rac.quantize_activation_triton(
        torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16), mask
    )
    per_row = tensor_act._replace(global_scale=tensor_act.global_scale.expand(tokens).contiguous())
    failures = []
    for config in forced_configs(w4a4_experts_gluon.grouped_gluon_kernel, bucket):
        try:
            _, hidden, y = _gluon_layer(gate_up_w, down_w, mask)(x, expert_ids, router_weights)
            x_q, residual = nvfp4.quantize_activation(x, mask, "row")
            assert_rows_close(
                hidden,
                rac.grouped_matmul_reference(
                    x_q,
                    gate_up_q,
                    routing.counts,
                    residual,
                    row_ids=routing.token_ids,
                    swiglu=True,
                    out_dtype=torch.float32,
                ),
                2e-3,
                "gluon row gate/up",
            )
            h_q, _ = nvfp4.quantize_activation(hidden.bfloat16(), None, "row")
            assert_rows_close(
                y,
                rac.grouped_matmul_reference(
                    h_q,
                    down_q,
                    routing.counts,
                    row_weights=router_weights,
                    row_weight_ids=routing.order,
                    out_dtype=torch.float32,
                ),
                1e-5,
                "gluon row down",
            )
            kwargs = dict(row_ids=routing.token_ids, swiglu=True)
            assert torch.equal(
                grouped(tensor_act, gate_up_w, routing.counts, **kwargs),
                grouped(per_row, gate_up_w, routing.counts, **kwargs),
            ), "row vs tensor bits"
            _, hidden, y = _gluon_layer(gate_up_w, down_w, quantize=False)(
                x, expert_ids, router_weights
            )
            rows = x.float()[routing.token_ids].split(routing.counts.tolist())
            gate, up = torch.cat(
                [r @ w.T for r, w in zip(rows, gate_up_q.dequantize(torch.float32))]
            ).chunk(2, -1)
            assert_rows_close(
                hidden, torch.nn.functional.silu(gate) * up, 1e-5, "gluon w4a16 gate/up"
            )
        except AssertionError as error:
            failures.append(f"{config}: {str(error).splitlines()[0][:200]}")
    assert not failures, "\n".join(failures)


@pytest.mark.cuda
def test_gluon_kernel_a_tokens_output_does_not_depend_on_its_batch_under_row_scales():
    # Qwen3's experts at 64 decode tokens, one token, and one among 40 others: one autotuning bucket
    # (4 rows an expert or fewer), so one configuration; the token's rows meet other tiles, half and
    # quarter tiles too
    if not _gluon_here():
        pytest.skip("the Gluon experts kernel runs on sm_89 and sm_90 only")
    E, D, I, A = 128, 2048, 768, 8
    generator = torch.Generator().manual_seed(0)

    def experts(shape):
        w = torch.randn(*shape, generator=generator).cuda() * 0.02
        return rac.chunk_experts(nvfp4.quantize_weight(w))

    gate_up_w = experts((E, 2 * I, D))
    down_w = experts((E, D, I))
    x = rows_of_many_magnitudes(64, D, 1).cuda()
    expert_ids = torch.rand(64, E, generator=generator).topk(A, dim=-1).indices.cuda()
    router_weights = torch.rand(64, A, generator=generator).cuda()
    extra = (
        torch.randn(40, D, generator=generator).cuda().bfloat16() * 1e3,
        torch.rand(40, E, generator=generator).topk(A, dim=-1).indices.cuda(),
        torch.rand(40, A, generator=generator).cuda(),
    )
    for mask in (None, torch.arange(D // 16, device="cuda") % 2 == 0):
        assert_batch_invariant(
            _gluon_layer(gate_up_w, down_w, mask), x, expert_ids, router_weights, extra, (0, 17, 63)
        )
