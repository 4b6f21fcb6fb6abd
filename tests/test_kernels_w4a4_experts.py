"""gpu_kernels/w4a4_experts.py: the experts' grouped W4A4 GEMM in Triton (gather + SwiGLU, router weights
read through routing.order, empty experts, the experts' blocked weight layout) against
rac.grouped_matmul_reference (CPU under TRITON_INTERPRET=1, GPU natively); its autotuning table; every GPU
configuration forced in turn at prefill size."""
import pytest
import torch
from conftest import report_diff
from test_kernels_w4a4_dense import deterministic_and_close

import moe
import nvfp4
import rac

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import w4a4_experts  # noqa: E402


def routing_with_empty_experts(n_experts, tokens, active, device, seed=0):
    """Random top-A routes that never pick experts 0, 2 and the last one (they receive no tokens)."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(n_experts) if e not in (0, 2, n_experts - 1)])
    scores = torch.rand(tokens, allowed.numel(), generator=generator)
    expert_ids = allowed[scores.topk(active, dim=-1).indices].to(device)
    return expert_ids, moe.route_tokens(expert_ids, n_experts)


def grouped(act, w, counts, **kwargs):
    """The Triton kernel itself, whatever rac.backend would choose on this device."""
    return w4a4_experts.grouped_matmul(act.operand, act.global_scale, w.data, w.block_scale, w.global_scale,
                                       counts, kwargs.pop("out_dtype", torch.float32), **kwargs)


@pytest.mark.parametrize("tokens, D", [(3, 80), (21, 80), (5, 256)])
def test_grouped_kernel_matches_the_per_expert_reference(kernel_device, tokens, D):
    # 21 tokens x 2 on 4 used experts: some experts get more rows than one 16-row tile. D = 80: the down
    # GEMM's output is 3 of the interpreter's 32-column tiles (the last one short); its K is one chunk of
    # ExpertWeights' layout, D = 256 two
    torch.manual_seed(tokens)
    E, I, A = 7, 32, 2
    expert_ids, routing = routing_with_empty_experts(E, tokens, A, kernel_device, seed=tokens)
    assert (routing.counts[[0, 2, E - 1]] == 0).all()
    x = torch.randn(tokens, D, device=kernel_device, dtype=torch.bfloat16)
    act = rac.quantize_activation_triton(x, torch.arange(D // 16, device=kernel_device) % 2 == 0,
                                         codes=True)
    gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device=kernel_device))
    hidden = grouped(act, rac.chunk_experts(gate_up_q), routing.counts, row_ids=routing.token_ids, swiglu=True)
    reference = rac.grouped_matmul_reference(act.x_q, gate_up_q, routing.counts, act.residual,
                                             row_ids=routing.token_ids, swiglu=True,
                                             out_dtype=torch.float32)
    assert hidden.shape == (tokens * A, I)
    assert report_diff(hidden, reference,
                       "grouped gate/up + swiglu")[0] <= 2e-3 * reference.abs().max().item()

    act = rac.quantize_activation_triton(reference, codes=True)
    down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device=kernel_device))
    down_w = rac.chunk_experts(down_q)
    row_weights = torch.rand(tokens * A, device=kernel_device)
    y = grouped(act, down_w, routing.counts, row_weights=row_weights)
    reference = rac.grouped_matmul_reference(act.x_q, down_q, routing.counts, row_weights=row_weights,
                                             out_dtype=torch.float32)
    assert report_diff(y, reference, "grouped down * router weight")[0] <= 1e-5 * reference.abs().max().item()
    # the router weights as the layer passes them: (T * A,) in assignment order, read through routing.order;
    # the oracle is the sorted path just checked, on the weights gathered by hand
    expert_weights = torch.rand(tokens, A, device=kernel_device, dtype=torch.bfloat16).reshape(-1)
    by_order = grouped(act, down_w, routing.counts, row_weights=expert_weights, row_weight_ids=routing.order)
    gathered = expert_weights[routing.order].float()
    assert torch.equal(by_order, grouped(act, down_w, routing.counts, row_weights=gathered))
    twin_by_order = rac.grouped_matmul_reference(act.x_q, down_q, routing.counts, row_weights=expert_weights,
                                                 row_weight_ids=routing.order, out_dtype=torch.float32)
    twin_sorted = rac.grouped_matmul_reference(act.x_q, down_q, routing.counts, row_weights=gathered,
                                               out_dtype=torch.float32)
    assert torch.equal(twin_by_order, twin_sorted)


def test_no_rows_give_an_empty_output(kernel_device):
    act = rac.quantize_activation_triton(torch.zeros(0, 32, device=kernel_device))
    w = rac.chunk_experts(nvfp4.quantize_weight(torch.randn(2, 32, 32, device=kernel_device)))
    y = grouped(act, w, torch.zeros(2, dtype=torch.int64, device=kernel_device), swiglu=True)
    assert y.shape == (0, 16)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_grouped_kernels_match_the_reference_on_qwen3_expert_shapes(tokens):
    # through rac.grouped_matmul_triton: the kernel rac.backend picks here (Gluon on sm_89 / sm_90), and
    # the Triton kernel itself
    torch.manual_seed(0)
    E, D, I, A = 128, 2048, 768, 8
    routing = moe.route_tokens(torch.rand(tokens, E, device="cuda").topk(A, dim=-1).indices, E)
    act = rac.quantize_activation_triton(torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16),
                                         torch.arange(D // 16, device="cuda") % 4 == 0, codes=True)
    gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02)
    reference = rac.grouped_matmul_reference(act.x_q, gate_up_q, routing.counts, act.residual,
                                             row_ids=routing.token_ids, swiglu=True, out_dtype=torch.float32)
    for name, call in (("chosen", rac.grouped_matmul_triton), ("triton", grouped)):
        hidden = call(act, rac.chunk_experts(gate_up_q), routing.counts, row_ids=routing.token_ids, swiglu=True,
                      out_dtype=torch.float32)
        assert report_diff(hidden, reference,
                           f"gpu grouped gate/up T={tokens} {name}")[0] <= 2e-3 * reference.abs().max().item()
    act = rac.quantize_activation_triton(reference.bfloat16(), codes=True)
    down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02)
    row_weights = torch.rand(tokens * A, device="cuda")
    down_reference = rac.grouped_matmul_reference(act.x_q, down_q, routing.counts, row_weights=row_weights,
                                                  out_dtype=torch.float32)
    for name, call in (("chosen", rac.grouped_matmul_triton), ("triton", grouped)):
        y = call(act, rac.chunk_experts(down_q), routing.counts, row_weights=row_weights, out_dtype=torch.float32)
        assert report_diff(y, down_reference,
                           f"gpu grouped down T={tokens} {name}")[0] <= 1e-4 * down_reference.abs().max().item()


def test_triton_grouped_autotuner_steps_k_within_one_chunk_of_the_layout(monkeypatch):
    # the Triton grouped kernel reads ExpertWeights directly: where K spans several 128-element chunks, its
    # GPU configurations' 256-element steps become 128 (a step may not cross a chunk); K of one chunk
    # (here 192) keeps every step; each bucket keeps its own configurations
    from gpu_kernels import w4a4_dense
    monkeypatch.setattr(w4a4_dense, "INTERPRET", False)  # the GPU table, not the interpreter's
    configs = w4a4_experts._configs(w4a4_experts.GROUPED_CONFIGS)
    assert any(c.kwargs["BLOCK_K"] == 256 for c in configs)
    assert any(c.maxnreg for c in configs)  # the table's register cap reaches Triton
    for bucket, entries in w4a4_experts.GROUPED_CONFIGS.items():
        for K, chunk in ((2048, 128), (192, 192)):
            kept = w4a4_experts._grouped_prune(configs, {"M_BUCKET": bucket, "K": K}, CHUNK=chunk)
            assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept] == \
                [(m, n, w, st) for m, n, _, w, st, *_ in entries]
            for c, (_, _, k, *_) in zip(kept, entries):
                assert c.kwargs["BLOCK_K"] == (min(k, chunk) if chunk < K else k), (bucket, K, c)
                assert chunk == K or chunk % c.kwargs["BLOCK_K"] == 0


@pytest.mark.cuda
def test_every_gpu_config_is_deterministic_and_matches_the_reference():
    # each configuration forced and repeated (a miscompiled one showed as run-to-run differences) at a
    # prefill of 512 evaluation prompts, 26k tokens, on the small preset's shapes
    import triton
    torch.manual_seed(0)
    E, D, I, A, T = 32, 512, 256, 4, 26112
    gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda") * 0.05)
    down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda") * 0.05)
    gate_up_w, down_w = rac.chunk_experts(gate_up_q), rac.chunk_experts(down_q)
    routing = moe.route_tokens(torch.rand(T, E, device="cuda").topk(A, dim=-1).indices, E)
    x = rac.quantize_activation_triton(torch.randn(T, D, device="cuda", dtype=torch.bfloat16), codes=True)
    h = rac.quantize_activation_triton(torch.randn(T * A, I, device="cuda", dtype=torch.bfloat16), codes=True)
    row_weights = torch.rand(T * A, device="cuda")
    bucket = w4a4_experts._m_bucket(triton.cdiv(T * A, E), w4a4_experts.GROUPED_CONFIGS)
    calls = {
        "gate/up": (w4a4_experts._grouped_kernel, bucket, lambda c: False,
                    lambda: grouped(x, gate_up_w, routing.counts, row_ids=routing.token_ids, swiglu=True),
                    rac.grouped_matmul_reference(x.x_q, gate_up_q, routing.counts, row_ids=routing.token_ids,
                                                 swiglu=True, out_dtype=torch.float32)),
        "down": (w4a4_experts._grouped_kernel, bucket, lambda c: False,
                 lambda: grouped(h, down_w, routing.counts, row_weights=row_weights),
                 rac.grouped_matmul_reference(h.x_q, down_q, routing.counts, row_weights=row_weights,
                                              out_dtype=torch.float32)),
    }
    failures = deterministic_and_close(calls)
    assert not failures, "\n".join(failures)
