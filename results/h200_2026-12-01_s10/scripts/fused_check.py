"""Each fused decode path against its twin inside a real rollout: 4 Qwen3-30B-A3B-shaped layers, 64 rows x 64
new tokens, bf16 and nvfp4 + RAC 0.5, greedy and sampled. Norm+RoPE and routing must change nothing."""
import copy
import torch
import moe, rac, rollout

config = moe.MoEConfig.from_preset("qwen3-30b-a3b", n_layers=4, vocab_size=32768, max_seq_len=1024)
torch.manual_seed(0)
with torch.device("cuda"):
    base = moe.MoETransformer(config).to(torch.bfloat16).eval()
g = torch.Generator().manual_seed(1)
prompts = torch.randint(1, 32768, (64, 64), generator=g).tolist()
fused = dict(norm_rope=moe.norm_rope, route_tokens=moe.route_tokens, sample_next=rollout.sample_next,
             router_top_k=moe.router_top_k)

def composition(x, norm, cos, sin):
    return moe.apply_rope(norm(x).transpose(1, 2), cos, sin)

def twin_sampler(logits, sampling, seed_key, rows, position):
    t, k, p = sampling["temperature"], sampling["top_k"], sampling["top_p"]
    noise = None if t == 0 else rollout.sampling_noise(seed_key, rows, position, logits.shape[-1])
    return rollout.sample_tokens(logits, t, k, p, noise)

import sys
twins = {"all fused": {}, "norm_rope twin": dict(norm_rope=composition),
         "routing twin": dict(route_tokens=moe.route_tokens_reference), "sampler twin": dict(sample_next=twin_sampler),
         "router twin": dict(router_top_k=moe.router_top_k_reference)}
if len(sys.argv) > 1:
    twins = {k: v for k, v in twins.items() if k == "all fused" or k in sys.argv[1:]}

def patch(replaced):
    for name, fn in {**fused, **replaced}.items():
        setattr(rollout if name == "sample_next" else moe, name, fn)

for mode, ratio in ((None, 0.0), ("nvfp4", 0.5)):
    model = copy.deepcopy(base)
    if mode:
        rac.convert_for_rollout(model, mode, rac_ratio=ratio)
    for temperature in (0.0, 1.0):
        outs = {}
        for label, replaced in twins.items():
            patch(replaced)
            rollout.free_decode_states(model)
            outs[label] = rollout.generate(model, prompts, 1, 64, temperature=temperature, seed=5)
        patch({})
        a = outs["all fused"]
        for label in list(twins)[1:]:
            b = outs[label]
            same = torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
            rows = (a.completion_ids == b.completion_ids).all(dim=1).float().mean().item()
            agree = (a.completion_ids == b.completion_ids).cumprod(1).bool()
            dlogp = (a.logprobs - b.logprobs).abs()[agree].max().item()
            print(f"{mode or 'bf16'} T={temperature} vs {label}: bit-identical={same}, rows identical {rows:.3f}, "
                  f"max |dlogp| before any token parts {dlogp:.2e}; graph {a.used_cuda_graph}")
    rollout.free_decode_states(model)
