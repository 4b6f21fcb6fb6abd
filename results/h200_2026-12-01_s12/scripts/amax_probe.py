"""Prefill quantizer parts (main's tree): the partial-amax launch in several shapes, the quantize launch alone,
and the whole quantizer; M = 4096, K = 2048 and 4096."""
import sys, torch, triton, nvfp4, rac
exec(open("/work/main/.devnext/prefill_ab.py").read().split("torch.manual_seed(0)")[0].split("print(rac.__file__)")[1])
torch.manual_seed(0)
for K in (2048, 4096):
    x = torch.randn(4096, K, device="cuda", dtype=torch.bfloat16)
    numel = x.numel()
    print(f"K={K}: whole quantizer {graph_us(lambda: rac.quantize_activation_triton(x)):.1f} us", flush=True)
    for slices, chunk_div, warps in [(256, 8, 4), (256, 1, 4), (256, 1, 8), (256, 1, 16), (256, 2, 8), (512, 1, 8),
                                     (1024, 1, 4), (1024, 1, 8), (128, 1, 16)]:
        slice_ = triton.cdiv(numel, slices)
        chunk = slice_ // chunk_div
        parts = torch.empty(slices, dtype=torch.float32, device="cuda")
        f = lambda: rac._partial_amax_kernel[(slices,)](x, parts, numel, SLICE=slice_, CHUNK=chunk, num_warps=warps)
        f(); torch.cuda.synchronize()
        ok = torch.equal(parts.max(), x.abs().max().float())
        print(f"  partial amax {slices} slices x {slice_} (chunk {chunk}), {warps} warps: {graph_us(f):.1f} us "
              f"{'ok' if ok else 'WRONG'}", flush=True)
    # the quantize launch alone, fed 256 partials
    slice_ = rac._AMAX_CHUNK * triton.cdiv(triton.cdiv(numel, rac._AMAX_CHUNK), rac._AMAX_SLICES)
    parts = torch.empty(triton.cdiv(numel, slice_), dtype=torch.float32, device="cuda")
    rac._partial_amax_kernel[(parts.numel(),)](x, parts, numel, SLICE=slice_, CHUNK=rac._AMAX_CHUNK)
    n_blocks = numel // 16
    gs = torch.empty((), dtype=torch.float32, device="cuda")
    out = rac._empty_planes(4096, K // 2, "cuda")
    d = torch.empty(1, dtype=torch.uint8, device="cuda")
    for blocks, warps in [(128, 4), (64, 4), (256, 8), (128, 8)]:
        q = lambda: rac._quantize_activation_kernel[(triton.cdiv(n_blocks, blocks),)](
            x, nvfp4._pair_view(x), d, parts, gs, d, d, d, d, out, numel, n_blocks, K // 16, parts.numel(),
            out.stride(0), AMAX_HERE=False, HAS_RESIDUAL=False, X_BF16=True, WRITE_CODES=False, WRITE_OPERAND=True,
            BLOCKS=blocks, CHUNK=rac._AMAX_CHUNK, GPU=True, PARTIALS=triton.next_power_of_2(parts.numel()),
            num_warps=warps)
        print(f"  quantize alone, {blocks} blocks a program, {warps} warps: {graph_us(q):.1f} us", flush=True)
