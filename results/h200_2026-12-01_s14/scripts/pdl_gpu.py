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
for mode, ratio in (("nvfp4", 0.0), ("nvfp4", 0.5)):
    model = copy.deepcopy(base)
    rac.convert_for_rollout(model, mode, rac_ratio=ratio)
    for batch in (64, 256):
        res = {True: [], False: []}
        toks = {}
        for rnd in range(3):
            for pdl in (True, False):
                rac._PDL_ENV = pdl
                rollout.free_decode_states(model)
                out = rollout.generate(model, prompts[:batch], 1, 144, seed=0)
                out = rollout.generate(model, prompts[:batch], 1, 144, seed=0)
                assert out.used_cuda_graph
                toks.setdefault(pdl, torch.cat([out.completion_ids.flatten().float(), out.logprobs.flatten()]))
                res[pdl].append(bench._graph_step_ms(model, 144))
        same = None
        if toks[True] is not None:
            same = torch.equal(toks[True], toks[False])
        print(f"{mode} rac {ratio} batch {batch}: PDL {' '.join(f'{t:.3f}' for t in res[True])} ms | "
              f"no PDL {' '.join(f'{t:.3f}' for t in res[False])} ms | min {min(res[True]):.3f} vs "
              f"{min(res[False]):.3f} ({(1 - min(res[True]) / min(res[False])) * 100:+.1f}%) tokens equal: {same}",
              flush=True)
    rollout.free_decode_states(model)
    del model
    torch.cuda.empty_cache()
