"""moe.sum_expert_rows on the GPU against the expression it replaces in rac.NVFP4Experts (y[inverse].view(T, A, D)
.sum(1): torch's gather + reduction), bit for bit, and both timed (graph of 10 calls, median of 30)."""
import torch, moe
exec(open("/work/main/.devnext/prefill_ab.py").read().split("torch.manual_seed(0)")[0].split("print(rac.__file__)")[1])
torch.manual_seed(0)
for T in (1, 64, 256):
    A, D, E = 8, 2048, 128
    routing = moe.route_tokens(torch.rand(T, E, device="cuda").topk(A, dim=-1).indices, E)
    y = torch.randn(T * A, D, device="cuda", dtype=torch.bfloat16)
    old = lambda: y[routing.inverse_order].view(T, A, -1).sum(dim=1)
    new = lambda: moe.sum_expert_rows(y, routing, A)
    same = torch.equal(old().view(torch.int16), new().view(torch.int16))
    print(f"T={T}: bit-identical {same}; torch gather + sum {graph_us(old):.1f} us, fused {graph_us(new):.1f} us",
          flush=True)
