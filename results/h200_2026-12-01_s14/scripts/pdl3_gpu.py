"""PDL on/off for rac's kernels in the decode step (4 Qwen3-30B-A3B layers, as bench.py decode): ms per step
from the captured graph, alternating, and the tokens of the two compared."""
import copy, sys, torch
import bench, moe, rac, rollout

config = moe.MoEConfig.from_preset("qwen3-30b-a3b", n_layers=4, vocab_size=32768, max_seq_len=1024)
torch.manual_seed(0)
with torch.device("cuda"):
    base = moe.MoETransformer(config).to(torch.bfloat16).eval()
g = torch.Generator().manual_seed(1)
prompts = torch.randint(1, 32768, (256, 64), generator=g).tolist()
for mode, ratio in (("nvfp4", 0.0),):
    model = copy.deepcopy(base)
    rac.convert_for_rollout(model, mode, rac_ratio=ratio)
    for batch in (64, 256):
        arms = [("off", False, "all", 1 << 30, ("pa", "q")), ("small", True, "small", 1 << 30, ("pa", "q")),
                ("t256", True, "small", 256, ("pa", "q")), ("t132", True, "small", 132, ("pa", "q")),
                ("pa", True, "small", 1 << 30, ("pa",)), ("q", True, "small", 1 << 30, ("q",)),
                ("q256", True, "small", 256, ("q",))]
        res = {a[0]: [] for a in arms}
        toks = {}
        for rnd in range(2):
            for pdl, on, trig, mx, which in arms:
                rac._PDL_ENV, rac._PDL_TRIGGER, rac._PDL_MAX, rac._PDL_WHICH = on, trig, mx, which
                rollout.free_decode_states(model)
                out = rollout.generate(model, prompts[:batch], 1, 144, seed=0)
                out = rollout.generate(model, prompts[:batch], 1, 144, seed=0)
                assert out.used_cuda_graph
                toks.setdefault(pdl, torch.cat([out.completion_ids.flatten().float(), out.logprobs.flatten()]))
                res[pdl].append(bench._graph_step_ms(model, 144))
        for a in res:
            print(f"{mode} rac {ratio} batch {batch} trigger {a:6s}: {' '.join(f'{t:.3f}' for t in res[a])} ms, "
                  f"min {min(res[a]):.3f} ({(1 - min(res[a]) / min(res['off'])) * 100:+.1f}% vs off) "
                  f"tokens+logprobs equal to off: {torch.equal(toks[a], toks['off'])}", flush=True)
    rollout.free_decode_states(model)
    del model
    torch.cuda.empty_cache()
