"""moe.py: logits match Hugging Face's Qwen3-MoE, sparse experts match a dense all-expert computation,
route replay, the KV-cache contract, and clear errors."""
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import report_diff

import moe
from moe import Experts, MoEBlock, MoEConfig, MoETransformer, load_hf, route_tokens

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402


# ----------------------------------------------------------------------------------------------- helpers
def tiny_config(**overrides):
    return MoEConfig.from_preset("tiny", **{"vocab_size": 48, "max_seq_len": 64, **overrides})


def random_model(config, std=0.3, seed=0):
    """A model with weights large enough that routing and attention patterns depend on them."""
    torch.manual_seed(seed)
    model = MoETransformer(config)
    model.init_weights(std=std)
    return model


def save_hf_model(directory, norm_topk_prob=True, n_kv_heads=2, tie=False, **overrides):
    """A tiny random Qwen3MoeForCausalLM written with save_pretrained; returns the HF model."""
    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=n_kv_heads, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        max_position_embeddings=64, norm_topk_prob=norm_topk_prob, tie_word_embeddings=tie, rope_theta=1e6,
        attn_implementation="eager", **overrides)
    torch.manual_seed(0)
    hf_model = transformers.Qwen3MoeForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():  # HF's N(0, 0.02) init leaves the router near uniform
            p.normal_(0.0, 0.3)
    hf_model.save_pretrained(directory)
    return hf_model


def rewrite_expert_layout(src, dst, fused):
    """Copy a checkpoint directory, storing the experts per-expert (hub layout) or fused (E, 2I, D) / (E, D, I)."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    n_layers = json.load(open(os.path.join(src, "config.json")))["num_hidden_layers"]
    for i in range(n_layers):
        prefix = f"model.layers.{i}.mlp.experts"
        if f"{prefix}.gate_up_proj" not in tensors:  # per-expert on disk: fuse first
            n_experts = sum(k.startswith(f"{prefix}.") and k.endswith(".gate_proj.weight") for k in tensors)
            gate, up, down = (torch.stack([tensors.pop(f"{prefix}.{e}.{p}.weight") for e in range(n_experts)])
                              for p in ("gate_proj", "up_proj", "down_proj"))
            tensors[f"{prefix}.gate_up_proj"], tensors[f"{prefix}.down_proj"] = torch.cat((gate, up), 1), down
        if not fused:
            gate_up, down = tensors.pop(f"{prefix}.gate_up_proj"), tensors.pop(f"{prefix}.down_proj")
            gate, up = gate_up.chunk(2, dim=1)
            for e in range(gate_up.shape[0]):
                tensors[f"{prefix}.{e}.gate_proj.weight"] = gate[e].contiguous()
                tensors[f"{prefix}.{e}.up_proj.weight"] = up[e].contiguous()
                tensors[f"{prefix}.{e}.down_proj.weight"] = down[e].contiguous()
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return tensors


def dense_moe_reference(experts, x, expert_ids, expert_weights):
    """Every expert on every token, masked by the routing: y = sum_e w[t, e] f_e(x[t])."""
    T, D = x.shape
    dense_weights = torch.zeros(T, experts.n_experts).index_put_(
        (torch.arange(T)[:, None].expand_as(expert_ids), expert_ids), expert_weights, accumulate=True)  # (T, E)
    y = torch.zeros(T, D)
    for e in range(experts.n_experts):
        gate, up = (x @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
        y += dense_weights[:, e:e + 1] * ((F.silu(gate) * up) @ experts.down_proj[e].T)
    return y


class ConcatKVCache:
    """The smallest object satisfying the cache contract: keeps every key/value, returns all of them."""

    def __init__(self, n_layers):
        self.keys, self.values = [None] * n_layers, [None] * n_layers

    def update(self, layer_idx, k, v):
        if self.keys[layer_idx] is not None:
            k = torch.cat((self.keys[layer_idx], k), dim=2)
            v = torch.cat((self.values[layer_idx], v), dim=2)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v


# ----------------------------------------------------------------------------------------------- Hugging Face
@pytest.mark.parametrize("norm_topk_prob,n_kv_heads,tie", [
    (True, 2, False), (False, 2, False), (True, 4, False), (False, 4, False), (True, 2, True),
], ids=["normtopk-gqa", "nonorm-gqa", "normtopk-mha", "nonorm-mha", "normtopk-gqa-tied"])
def test_logits_match_hugging_face_qwen3_moe(tmp_path, norm_topk_prob, n_kv_heads, tie):
    hf_model = save_hf_model(tmp_path, norm_topk_prob, n_kv_heads, tie)
    model, tokenizer = load_hf(str(tmp_path))
    assert tokenizer is None  # none was saved
    assert model.config.norm_topk_prob == norm_topk_prob and model.config.n_kv_heads == n_kv_heads
    assert model.config.rope_theta == 1e6 and model.config.tie_embeddings == tie
    tokens = torch.randint(48, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf_model(tokens).logits, model(tokens)
    max_diff, _ = report_diff(got, expected, "logits vs HF")
    assert max_diff < 1e-4


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_both_expert_layouts_load_to_the_same_logits(tmp_path, fused):
    hf_model = save_hf_model(tmp_path / "saved")
    rewrite_expert_layout(tmp_path / "saved", tmp_path / "rewritten", fused)
    model, _ = load_hf(str(tmp_path / "rewritten"))
    tokens = torch.randint(48, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        max_diff, _ = report_diff(model(tokens), hf_model(tokens).logits, f"fused={fused}")
    assert max_diff < 1e-4


def test_load_hf_casts_to_the_requested_dtype(tmp_path):
    save_hf_model(tmp_path)
    model, _ = load_hf(str(tmp_path), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model(torch.zeros(1, 4, dtype=torch.long)).dtype == torch.bfloat16


def test_load_hf_rejects_another_architecture(tmp_path):
    transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="qwen3_moe.*'llama'"):
        load_hf(str(tmp_path))


def test_load_hf_names_unsupported_features(tmp_path):
    transformers.Qwen3MoeConfig(mlp_only_layers=[0], attention_bias=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="mlp_only_layers.*attention_bias"):
        load_hf(str(tmp_path))


def test_load_hf_lists_missing_and_unexpected_tensors(tmp_path):
    save_hf_model(tmp_path / "saved")
    tensors = rewrite_expert_layout(tmp_path / "saved", tmp_path / "broken", fused=False)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    del tensors["model.layers.0.mlp.experts.3.down_proj.weight"]
    tensors["model.layers.0.mlp.shared_expert.gate_proj.weight"] = torch.zeros(4, 32)
    save_file(tensors, os.path.join(tmp_path / "broken", "model.safetensors"))
    with pytest.raises(ValueError) as error:
        load_hf(str(tmp_path / "broken"))
    message = str(error.value)
    assert "layers.1.attn.k_norm.weight" in message  # missing
    assert "model.layers.0.mlp.shared_expert.gate_proj.weight" in message  # unexpected
    assert "model.layers.0.mlp.experts.*: incomplete" in message and "layers.0.mlp.experts.down_proj" in message


# ----------------------------------------------------------------------------------------------- experts
def test_sparse_experts_match_dense_all_expert_computation():
    torch.manual_seed(0)
    experts = Experts(tiny_config())
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(experts.down_proj, std=0.3)
    x = torch.randn(40, 64)
    # Experts 0 and 5 get no tokens (empty groups), and some tokens repeat an expert (forced routes may).
    expert_ids = torch.tensor([1, 2, 3, 4, 6, 7])[torch.randint(6, (40, 2))]
    expert_weights = torch.rand(40, 2)
    max_diff, _ = report_diff(experts(x, expert_ids, expert_weights),
                              dense_moe_reference(experts, x, expert_ids, expert_weights), "sparse vs dense")
    assert max_diff < 1e-5


def test_moe_block_routes_top_k_of_fp32_softmax_like_the_dense_reference():
    for norm_topk_prob in (True, False):
        torch.manual_seed(0)
        block = MoEBlock(tiny_config(norm_topk_prob=norm_topk_prob))
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.3)
        x = torch.randn(2, 25, 64)
        y, routes = block(x)
        assert y.shape == (2, 25, 64) and routes.shape == (2, 25, 2) and routes.dtype == torch.int64
        probs = torch.softmax(block.gate(x.view(-1, 64)).float(), dim=-1)
        weights, ids = probs.topk(2, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        assert torch.equal(routes.view(-1, 2), ids)
        expected = dense_moe_reference(block.experts, x.view(-1, 64), ids, weights)
        assert report_diff(y.view(-1, 64), expected, f"norm_topk_prob={norm_topk_prob}")[0] < 1e-5


def test_route_tokens_groups_assignments_by_expert():
    expert_ids = torch.tensor([[3, 0], [0, 2], [3, 1], [0, 3]])  # (T=4, A=2)
    routing = route_tokens(expert_ids, n_experts=5)
    flat = expert_ids.reshape(-1)
    assert flat[routing.order].tolist() == [0, 0, 0, 1, 2, 3, 3, 3]
    assert routing.token_ids.tolist() == [0, 1, 3, 2, 1, 0, 2, 3]  # stable: token order within an expert
    assert routing.counts.tolist() == [3, 1, 1, 3, 0]
    assert routing.offsets.tolist() == [3, 4, 5, 8, 8] and routing.offsets.dtype == torch.int32
    assert torch.equal(routing.order[routing.inverse_order], torch.arange(8))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm not in this torch")
def test_grouped_mm_fast_path_matches_loop_twin_in_bf16_on_cpu():
    torch.manual_seed(0)
    E, D, I, N = 4, 64, 32, 48
    gate_up = torch.randn(E, 2 * I, D, dtype=torch.bfloat16, requires_grad=True)
    down = torch.randn(E, D, I, dtype=torch.bfloat16, requires_grad=True)
    routing = route_tokens(torch.tensor([0, 0, 2, 3])[torch.randint(4, (N, 1))], E)  # expert 1 empty
    x = torch.randn(N, D, dtype=torch.bfloat16)[routing.token_ids]
    fast = moe.expert_swiglu_grouped(x, routing.offsets, gate_up, down)
    fast_grads = torch.autograd.grad(fast.float().square().sum(), (gate_up, down))
    slow = moe.expert_swiglu_loop(x, routing.counts, gate_up, down)
    slow_grads = torch.autograd.grad(slow.float().square().sum(), (gate_up, down))
    scale = slow.float().abs().max()
    assert report_diff(fast, slow, "grouped vs loop")[0] <= 1e-2 * scale
    for g_fast, g_slow in zip(fast_grads, slow_grads):
        assert report_diff(g_fast, g_slow, "grad")[0] <= 1e-2 * g_slow.float().abs().max()


@pytest.mark.cuda
def test_cuda_bf16_experts_take_grouped_mm_and_match_fp32_loop():
    torch.manual_seed(0)
    experts = Experts(MoEConfig.from_preset("small")).cuda()
    torch.nn.init.normal_(experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(experts.down_proj, std=0.05)
    x = torch.randn(512, 512, device="cuda")
    expert_ids = torch.randint(32, (512, 4), device="cuda")
    expert_weights = torch.rand(512, 4, device="cuda")
    assert moe.use_grouped_mm(x.bfloat16(), expert_dim=256)
    reference = experts(x, expert_ids, expert_weights)  # fp32 on CUDA: the loop
    reference_grad = torch.autograd.grad(reference.square().sum(), experts.down_proj)[0]
    fast_experts = Experts(MoEConfig.from_preset("small")).cuda().bfloat16()
    fast_experts.load_state_dict(experts.state_dict())
    fast = fast_experts(x.bfloat16(), expert_ids, expert_weights)
    fast_grad = torch.autograd.grad(fast.float().square().sum(), fast_experts.down_proj)[0]
    assert report_diff(fast, reference, "cuda grouped bf16 vs fp32")[0] < 2e-2 * reference.abs().max()
    assert report_diff(fast_grad, reference_grad, "grad")[0] < 3e-2 * reference_grad.abs().max()


# ----------------------------------------------------------------------------------------------- routes, cache
def test_replaying_recorded_routes_reproduces_logits_exactly():
    model = random_model(tiny_config())
    tokens = torch.randint(48, (3, 16))
    logits, routes = model(tokens, return_routes=True)
    assert routes.shape == (2, 3, 16, 2) and routes.dtype == torch.int64
    replayed, replayed_routes = model(tokens, forced_routes=routes, return_routes=True)
    assert torch.equal(replayed, logits) and torch.equal(replayed_routes, routes)


def test_forced_routes_choose_the_experts_and_the_router_still_gets_gradients():
    model = random_model(tiny_config())
    tokens = torch.randint(48, (2, 12))
    forced = torch.rand(2, 2, 12, 8).argsort(dim=-1)[..., :2]  # (L, B, T, A) distinct random experts
    logits, routes = model(tokens, forced_routes=forced, return_routes=True)
    assert torch.equal(routes, forced)
    assert not torch.allclose(logits, model(tokens))  # other experts than the router's top-k really ran
    F.cross_entropy(logits.flatten(0, 1), torch.randint(48, (24,))).backward()
    for layer in model.layers:
        grad = layer.mlp.gate.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_prefill_then_decode_with_kv_cache_matches_full_forward():
    model = random_model(tiny_config())
    B, P, T = 2, 6, 10
    tokens = torch.randint(48, (B, T))
    full = model(tokens)
    cache = ConcatKVCache(model.config.n_layers)
    causal = torch.ones(P, P, dtype=torch.bool).tril()[None, None]            # (1, 1, P, P)
    prefill = model(tokens[:, :P], positions=torch.arange(P).expand(B, P), attn_mask=causal, kv_cache=cache)
    diffs = [report_diff(prefill, full[:, :P], "prefill")[0]]
    for t in range(P, T):
        step = model(tokens[:, t:t + 1], positions=torch.full((B, 1), t), kv_cache=cache,
                     attn_mask=torch.ones(B, 1, 1, t + 1, dtype=torch.bool))
        diffs.append(report_diff(step[:, 0], full[:, t], f"decode {t}")[0])
    assert cache.keys[0].shape == (B, model.config.n_kv_heads, T, model.config.head_dim)
    assert max(diffs) < 1e-5


# ----------------------------------------------------------------------------------------------- config, errors
@pytest.mark.parametrize("fields,message", [
    (dict(n_heads=6, n_kv_heads=4), "not divisible by n_kv_heads"),
    (dict(n_active=9), "exceeds n_experts=8"),
    (dict(head_dim=15), "must be even"),
    (dict(vocab_size=0), "vocab_size must be a positive int"),
])
def test_config_rejects_inconsistent_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**fields)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="qwen3-30b-a3b"):
        MoEConfig.from_preset("huge")


def test_qwen3_30b_a3b_preset_has_the_published_parameter_counts():
    with torch.device("meta"):
        model = MoETransformer(MoEConfig.from_preset("qwen3-30b-a3b"))
    assert 30.0e9 < model.num_params() < 31.0e9           # "30.5B total"
    assert 3.2e9 < model.num_params(active=True) < 3.5e9   # "3.3B activated"


def test_forward_rejects_bad_inputs_with_clear_errors():
    model = MoETransformer(tiny_config())
    tokens = torch.randint(48, (2, 5))
    with pytest.raises(ValueError, match=r"shape \(B, T\), got \(10,\)"):
        model(tokens.view(-1))
    with pytest.raises(ValueError, match="integer tensor"):
        model(tokens.float())
    with pytest.raises(ValueError, match="with a kv_cache, pass attn_mask"):
        model(tokens, kv_cache=ConcatKVCache(2))
    with pytest.raises(ValueError, match="attn_mask must be bool"):
        model(tokens, attn_mask=torch.zeros(2, 1, 5, 5))
    with pytest.raises(ValueError, match=r"forced_routes must be \(L, B, T, A\)"):
        model(tokens, forced_routes=torch.zeros(2, 5, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"expert ids in \[0, 8\)"):
        model(tokens, forced_routes=torch.full((2, 2, 5, 2), 8))
    with pytest.raises(ValueError, match="exceed max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_swappable_layers_lists_attention_linears_and_experts_and_optionally_router_and_head():
    model = moe.MoETransformer(tiny_config())
    n_layers = model.config.n_layers
    default = moe.swappable_layers(model)
    assert sum(isinstance(m, moe.Experts) for _, _, m in default) == n_layers
    assert sorted({name for parent, name, m in default if isinstance(parent, moe.Attention)}) == \
        ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert len(default) == 5 * n_layers
    everything = moe.swappable_layers(model, include_router=True, include_lm_head=True)
    assert len(everything) == 6 * n_layers + 1
    assert any(parent is model and name == "lm_head" for parent, name, _ in everything)
