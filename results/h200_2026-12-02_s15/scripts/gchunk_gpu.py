import os, sys
sys.path.insert(0, os.path.dirname(__file__))
import torch
import moe, nvfp4, rac
import gchunk
from gg_gpu_common import graph_us, cmp
torch.manual_seed(0)
E, D, I, A = 128, 2048, 768, 8
dev = "cuda"
gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device=dev, dtype=torch.bfloat16) * 0.02)
down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device=dev, dtype=torch.bfloat16) * 0.02)
CH = {}
def ch(w, C, RB):
    if (id(w), C, RB) not in CH:
        CH.clear()
        CH[(id(w), C, RB)] = gchunk.chunk_experts(w.data, w.block_scale, C, RB)
    return CH[(id(w), C, RB)]
GU = [(C, RB, cfg) for C, RB in ((128, 64), (128, 16), (64, 64), (128, 128))
      for cfg in (dict(BLOCK_T=8, BLOCK_K=min(C, 128)), dict(BLOCK_T=16, BLOCK_K=min(C, 128)), dict(BLOCK_T=32, BLOCK_K=64))]
DN = [(C, RB, cfg) for C, RB in ((128, 64), (128, 16), (64, 64), (128, 128))
      for cfg in (dict(BLOCK_T=8, BLOCK_N=128, BLOCK_K=min(C, 128)), dict(BLOCK_T=16, BLOCK_N=128, BLOCK_K=min(C, 128)),
                  dict(BLOCK_T=32, BLOCK_N=128, BLOCK_K=64), dict(BLOCK_T=8, BLOCK_N=64, BLOCK_K=min(C, 128)))]
for T in (64, 256):
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(T, E, device=dev).topk(A, dim=-1).indices
    wts = torch.softmax(torch.randn(T, A, device=dev), dim=-1).reshape(-1)
    routing = moe.route_tokens(ids, E)
    act_x = rac.quantize_activation_triton(x)
    act_h = rac.quantize_activation_triton(torch.randn(T * A, I, device=dev, dtype=torch.bfloat16))
    print(f"\n## {T} tokens")
    tri = rac.grouped_matmul_triton(act_x, gate_up_q, routing.counts, row_ids=routing.token_ids, swiglu=True)
    print(f"gate/up triton {graph_us(lambda: rac.grouped_matmul_triton(act_x, gate_up_q, routing.counts, row_ids=routing.token_ids, swiglu=True)):.1f}")
    for C, RB, cfg in GU:
        f = lambda: gchunk.grouped(act_x, gate_up_q, ch(gate_up_q, C, RB), C, RB, routing.counts, row_ids=routing.token_ids, swiglu=True, **cfg)
        y = f()
        print(f"gate/up C={C} RB={RB} {cfg}: {graph_us(f):.1f} us; vs triton {cmp(y, tri)}", flush=True)
    tri = rac.grouped_matmul_triton(act_h, down_q, routing.counts, row_weights=wts, row_weight_ids=routing.order)
    print(f"down triton {graph_us(lambda: rac.grouped_matmul_triton(act_h, down_q, routing.counts, row_weights=wts, row_weight_ids=routing.order)):.1f}")
    for C, RB, cfg in DN:
        f = lambda: gchunk.grouped(act_h, down_q, ch(down_q, C, RB), C, RB, routing.counts, row_weights=wts, row_weight_ids=routing.order, **cfg)
        y = f()
        print(f"down C={C} RB={RB} {cfg}: {graph_us(f):.1f} us; vs triton {cmp(y, tri)}", flush=True)
