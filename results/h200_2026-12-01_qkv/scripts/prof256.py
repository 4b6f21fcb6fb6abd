"""Per-kernel time of one decode step at batch 256 (difference of two generate lengths)."""
import copy, collections
import torch
import moe, rac, rollout
from torch.profiler import profile, ProfilerActivity
def kernel_times(model, prompts, n):
    rollout.generate(model, prompts, 1, n, seed=0); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rollout.generate(model, prompts, 1, n, seed=1); torch.cuda.synchronize()
    out = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:90]] += e.device_time_total
    return out
config = moe.MoEConfig.from_preset("qwen3-30b-a3b", n_layers=4, vocab_size=32768, max_seq_len=1024)
torch.manual_seed(0)
with torch.device("cuda"):
    base = moe.MoETransformer(config).to(torch.bfloat16).eval()
g = torch.Generator().manual_seed(1)
prompts = torch.randint(1, 32768, (256, 64), generator=g).tolist()
for mode, ratio in [(None, 0), ("nvfp4", 0.5)]:
    model = copy.deepcopy(base)
    if mode: rac.convert_for_rollout(model, mode, rac_ratio=ratio)
    a, b = kernel_times(model, prompts, 16), kernel_times(model, prompts, 48)
    diff = {k: (b[k] - a.get(k, 0)) / 32 for k in b}
    total = sum(diff.values())
    print(f"\n## {mode or 'bf16'} rac {ratio} batch 256: kernel time per decode step {total:.1f} us", flush=True)
    for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:30]:
        print(f"{v:9.1f} us {100*v/total:5.1f}%  {k}")
    rollout.free_decode_states(model); del model; torch.cuda.empty_cache()
