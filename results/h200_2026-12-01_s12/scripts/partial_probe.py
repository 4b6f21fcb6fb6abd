"""The whole activation quantizer (rac.quantize_activation_triton, as the layers call it) with the partial-max launch's
chunk and warps patched; graph replays of 10 calls, median of 30."""
import torch, rac
exec(open("/work/main/.devnext/prefill_ab.py").read().split("torch.manual_seed(0)")[0].split("print(rac.__file__)")[1])
torch.manual_seed(0)
cands = [(4096, 4), (8192, 4), (16384, 4), (16384, 8), (32768, 8)]
print("shape | " + " | ".join(f"chunk {c} {w}w" for c, w in cands))
for M, K in [(64, 2048), (256, 2048), (64, 4096), (256, 4096), (512, 768), (2048, 768), (4096, 2048), (4096, 4096),
             (32768, 768)]:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    mask = torch.arange(K // 16, device="cuda") % 2 == 0
    row, ref = [], None
    for c, w in cands:
        rac._PARTIAL_CHUNK, rac._PARTIAL_WARPS = c, w
        gs = rac.quantize_activation_triton(x).global_scale
        ref = gs if ref is None else ref
        assert torch.equal(gs, ref)
        row.append(f"{graph_us(lambda: rac.quantize_activation_triton(x)):.1f} / "
                   f"{graph_us(lambda: rac.quantize_activation_triton(x, mask)):.1f}")
    print(f"{M}x{K} | " + " | ".join(row), flush=True)
