"""Is the greedy divergence between two trees a near-tie? Teacher-forced logits (one prefill forward) of the
old tree's tokens under this tree's model; at each row's first differing position: the top-2 logit gap,
against the gap distribution over all generated positions. Then greedy tokens with the fused RMSNorm
replaced by its torch twin (does the divergence vanish?)."""
import torch, moe, rac, rollout
old, new = torch.load(".devnext/old.pt"), torch.load(".devnext/new.pt")
config = moe.MoEConfig.from_preset("qwen3-30b-a3b", n_layers=2, vocab_size=4096, max_seq_len=512)
torch.manual_seed(0)
with torch.device("cuda"):
    model = moe.MoETransformer(config).to(torch.bfloat16).eval()
rac.convert_for_rollout(model, "nvfp4", rac_ratio=0.5)
g = torch.Generator().manual_seed(1)
prompts = torch.randint(1, 4096, (32, 24), generator=g).tolist()
rac.calibrate_rac(model, torch.tensor(prompts, device="cuda"))
with torch.no_grad():
    logits = model(old.cuda()).float()                                   # (32, 88, V)
top2 = logits.topk(2, dim=-1)
gap = (top2.values[..., 0] - top2.values[..., 1])[:, 23:-1]             # predicting tokens 24..87
first = [int((old[r] != new[r]).nonzero()[0]) for r in range(old.shape[0])]
gaps_at = torch.stack([top2.values[r, p - 1, 0] - top2.values[r, p - 1, 1] for r, p in enumerate(first)])
old_vs_new = torch.stack([logits[r, p - 1, old[r, p]] - logits[r, p - 1, new[r, p]] for r, p in enumerate(first)])
print("logit std", logits.std().item())
print("top-2 gap over generated positions: median %.4f, p10 %.4f, p1 %.5f" % (
    gap.median(), gap.flatten().quantile(0.1), gap.flatten().quantile(0.01)))
print("top-2 gap at the first differing position, per row:", [round(v, 4) for v in gaps_at.tolist()])
print("logit(old token) - logit(new token) there:", [round(v, 4) for v in old_vs_new.tolist()])
print("teacher-forced argmax == old token:", (logits[:, 23:-1].argmax(-1) == old[:, 24:].cuda()).float().mean().item())
moe.rms_norm_triton = lambda x, w, eps: moe.rms_norm_reference(x, w, eps)
rac.calibrate_rac(model, torch.tensor(prompts, device="cuda"))
out = rollout.generate(model, prompts, 1, 64, temperature=0.0, seed=0).sequences().tokens.cpu()
print("with the torch RMSNorm: tokens equal to old", (out == old).float().mean().item(),
      "rows identical", (out == old).all(1).float().mean().item())
