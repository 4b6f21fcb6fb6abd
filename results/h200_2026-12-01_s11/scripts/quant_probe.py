"""The activation quantizer's two launches timed apart, and the quantize launch's BLOCKS / warps variants."""
import torch, triton, nvfp4, rac
from rac import _partial_amax_kernel, _quantize_activation_kernel, _AMAX_CHUNK, _AMAX_SLICES, _empty_planes

def graph_us(fn, n=10, reps=20):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3 / n)
    return sorted(ts)[len(ts) // 2]

torch.manual_seed(0)
for M, K in [(4096, 2048), (4096, 4096), (256, 2048), (2048, 768), (64, 2048)]:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    n_blocks = M * K // 16
    dummy = torch.empty(1, dtype=torch.uint8, device="cuda")
    slice_ = _AMAX_CHUNK * triton.cdiv(triton.cdiv(x.numel(), _AMAX_CHUNK), _AMAX_SLICES)
    partials = torch.empty(triton.cdiv(x.numel(), slice_), dtype=torch.float32, device="cuda")
    amax = lambda: _partial_amax_kernel[(partials.numel(),)](x, partials, x.numel(), SLICE=slice_, CHUNK=_AMAX_CHUNK)
    amax()
    operand = _empty_planes(M, K // 2, "cuda")
    gs = torch.empty((), dtype=torch.float32, device="cuda")
    line = [f"{M}x{K}: whole {graph_us(lambda: rac.quantize_activation_triton(x)):.1f} "
            f"rac {graph_us(lambda: rac.quantize_activation_triton(x, torch.arange(K // 16, device='cuda') % 2 == 0)):.1f} "
            f"partial-amax {graph_us(amax):.1f} |"]
    for res in (False, True):
        mask = (torch.arange(K // 16, device="cuda") % 2 == 0).view(torch.uint8)
        for blocks, warps in [(32, 4), (64, 4), (128, 4), (128, 2), (128, 8), (256, 4), (256, 8), (512, 8)]:
            def q():
                _quantize_activation_kernel[(triton.cdiv(n_blocks, blocks),)](
                    x, nvfp4._pair_view(x), mask, partials, gs, dummy, dummy, dummy, dummy, operand,
                    x.numel(), n_blocks, K // 16, partials.numel(), operand.stride(0),
                    AMAX_HERE=False, HAS_RESIDUAL=res, X_BF16=True, WRITE_CODES=False, WRITE_OPERAND=True,
                    BLOCKS=blocks, CHUNK=_AMAX_CHUNK, GPU=True, PARTIALS=triton.next_power_of_2(partials.numel()),
                    num_warps=warps)
            line.append(f"{'rac ' if res else ''}{blocks}/{warps}w {graph_us(q):.1f}")
    print(" ".join(line), flush=True)
