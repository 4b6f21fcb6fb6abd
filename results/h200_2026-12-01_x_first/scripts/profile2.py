"""Op-level CUDA time of eager decode steps (nvfp4, batch 64): which torch ops cost what."""
import copy, torch, moe, rac, rollout
from torch.profiler import profile, ProfilerActivity
config = moe.MoEConfig.from_preset("qwen3-30b-a3b", n_layers=4, vocab_size=32768, max_seq_len=1024)
torch.manual_seed(0)
with torch.device("cuda"):
    model = moe.MoETransformer(config).to(torch.bfloat16).eval()
rac.convert_for_rollout(model, "nvfp4", rac_ratio=0.5)
g = torch.Generator().manual_seed(1)
prompts = torch.randint(1, 32768, (64, 64), generator=g).tolist()
rollout.generate(model, prompts, 1, 8, seed=0, cuda_graph=False)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    rollout.generate(model, prompts, 1, 33, seed=1, cuda_graph=False)
    torch.cuda.synchronize()
ka = prof.key_averages(group_by_input_shape=True)
rows = sorted(ka, key=lambda e: -e.self_device_time_total)
print(f"{'self CUDA us/step':>18} {'calls/step':>10}  op  shapes")
for e in rows[:45]:
    print(f"{e.self_device_time_total / 32:18.1f} {e.count / 32:10.1f}  {e.key[:40]}  {str(e.input_shapes)[:110]}")
