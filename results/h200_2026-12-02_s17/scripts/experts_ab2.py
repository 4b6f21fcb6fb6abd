"""A/B of the experts layer (RAC 0.5): two rac files, same process, same inputs, alternated.
usage: python experts_ab2.py rac_a.py label_a rac_b.py label_b"""
import importlib.util, sys, torch, torch.nn.functional as F
import moe, nvfp4, bench

def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)
    return mod

mods = {sys.argv[2]: load(sys.argv[1], "rac_a"), sys.argv[4]: load(sys.argv[3], "rac_b")}
print(bench.gpu_header())
bf16 = torch.bfloat16
D, E, A, I = 2048, 128, 8, 768

def graph_us(call, n=1):
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2): call()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): call()
    return bench.bench_ms(g.replay) * 1e3

torch.manual_seed(0)
gate_up = torch.randn(E, 2 * I, D, device="cuda", dtype=bf16) * 0.02
down = torch.randn(E, D, I, device="cuda", dtype=bf16) * 0.02
for T in (64, 96, 128, 192, 256):
    x = torch.randn(T, D, device="cuda", dtype=bf16)
    expert_ids = torch.rand(T, E, device="cuda").topk(A, dim=-1).indices
    weights = torch.softmax(torch.randn(T, A, device="cuda"), dim=-1)
    routing = moe.route_tokens(expert_ids, E)
    ew = weights.reshape(-1)
    layers, outs = {}, {}
    for name, r in mods.items():
        layer = r.NVFP4Experts(E, D, I, rac_ratio=0.5, device="cuda")
        layer.load_weights(gate_up, down)
        for s in (layer.rac_gate_up, layer.rac_down):
            s.mask.copy_(torch.arange(s.n_blocks, device="cuda") % 2 == 0); s.calibrated = True
        layers[name] = layer
        outs[name] = layer._forward_triton(x, routing, ew)
    names = list(mods)
    diff = (outs[names[0]].float() - outs[names[1]].float()).abs().max().item()
    res = {n: [] for n in names}
    for rep in range(3):
        for n in (names if rep % 2 == 0 else names[::-1]):
            res[n].append(graph_us(lambda: layers[n]._forward_triton(x, routing, ew)))
    print(f"T={T} max|diff|={diff:.3e} " + " ".join(f"{n}: {min(v):.1f} us ({', '.join(f'{t:.1f}' for t in v)})" for n, v in res.items()), flush=True)
