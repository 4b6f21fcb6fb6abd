"""Greedy nvfp4 + RAC 0.5 rollout tokens of a fixed random model (seed 0, Qwen3-30B-A3B layer shapes, 2
layers) and fixed prompts, saved to argv[1] (run once per tree; compare the two files)."""
import sys, torch, moe, rac, rollout
config = moe.MoEConfig.from_preset("qwen3-30b-a3b", n_layers=2, vocab_size=4096, max_seq_len=512)
torch.manual_seed(0)
with torch.device("cuda"):
    model = moe.MoETransformer(config).to(torch.bfloat16).eval()
rac.convert_for_rollout(model, "nvfp4", rac_ratio=0.5)
g = torch.Generator().manual_seed(1)
prompts = torch.randint(1, 4096, (32, 24), generator=g).tolist()
rac.calibrate_rac(model, torch.tensor(prompts, device="cuda"))
out = rollout.generate(model, prompts, 1, 64, temperature=0.0, seed=0)
torch.save(out.sequences().tokens.cpu(), sys.argv[1])
print("saved", tuple(out.sequences().tokens.shape))
