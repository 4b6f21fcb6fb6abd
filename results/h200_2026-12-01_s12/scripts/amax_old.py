import sys, torch, triton, nvfp4, rac
exec(open("/work/main/.devnext/prefill_ab.py").read().split("torch.manual_seed(0)")[0].split("print(rac.__file__)")[1])
print(rac.__file__)
for K in (2048, 4096):
    x = torch.randn(4096, K, device="cuda", dtype=torch.bfloat16)
    numel = x.numel()
    pb = max(8192, triton.next_power_of_2(triton.cdiv(numel, 1024))); n = triton.cdiv(numel, pb)
    parts = torch.empty(n, dtype=torch.float32, device="cuda")
    f = lambda: rac._partial_amax_kernel[(n,)](x, parts, numel, BLOCK=pb)
    print(f"K={K}: whole quantizer {graph_us(lambda: rac.quantize_activation_triton(x, None, codes=False, operand=True)):.1f}"
          f" us; partial amax {n} x {pb}: {graph_us(f):.1f} us", flush=True)
