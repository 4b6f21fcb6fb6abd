"""Where a decode step's GPU time goes: kernel times of CUDA-graph replays, by kernel, per precision."""
import collections, copy, sys, time
import torch
import moe, rac, rollout

config = moe.MoEConfig.from_preset("qwen3-30b-a3b", n_layers=4, vocab_size=32768, max_seq_len=1024)
torch.manual_seed(0)
with torch.device("cuda"):
    base = moe.MoETransformer(config).to(torch.bfloat16).eval()
g = torch.Generator().manual_seed(1)
prompts = torch.randint(1, 32768, (256, 64), generator=g).tolist()
variants = [("nvfp4", "nvfp4", 0.0), ("nvfp4 + RAC 0.5", "nvfp4", 0.5)]
for name, mode, ratio in variants:
    model = copy.deepcopy(base)
    if mode:
        rac.convert_for_rollout(model, mode, rac_ratio=ratio)
    for B in (64, 256):
        rollout.generate(model, prompts[:B], 1, 48, seed=0)
        states = rollout._POOLS[model][1]
        state = list(states.values())[-1]
        assert state.graph is not None
        reps = 20
        state.cache.length.fill_(state.prompt_width)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            state.graph.replay()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / reps * 1e3
        state.cache.length.fill_(state.prompt_width)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                state.graph.replay()
            torch.cuda.synchronize()
        totals, counts = collections.Counter(), collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                totals[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                counts[e.name] += 1
        total = sum(totals.values()) / reps
        print(f"\n## {name}, batch {B}: wall {wall:.3f} ms/step, kernel time {total/1e3:.3f} ms/step, "
              f"{sum(counts.values())/reps:.0f} kernels/step")
        for k, v in totals.most_common(40):
            print(f"{v/reps:9.1f} us  {counts[k]/reps:5.1f}x  {k[:150]}")
        sys.stdout.flush()
    rollout.free_decode_states(model)
    del model
    torch.cuda.empty_cache()
