"""moe.py: logits match Hugging Face's Qwen3-MoE, sparse experts match a dense all-expert
computation, route replay, the KV-cache contract, and clear errors."""

import itertools
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import raises_one_line, report_diff, tiny_model
from safetensors.torch import load_file, save_file

import moe
from moe import Experts, MoEBlock, MoEConfig, MoETransformer, load_hf, route_tokens

VOCAB = 48


# ------------------------------------------------------------------------------------------ helpers
def tiny_config(**overrides):
    return MoEConfig.from_preset("tiny", **{"vocab_size": VOCAB, "max_seq_len": 64, **overrides})


def random_model():
    """Weights large enough (N(0, 0.3)) that routing and attention patterns depend on them."""
    return tiny_model(std=0.3, vocab_size=VOCAB)


def save_hf_model(directory, norm_topk_prob=True, n_kv_heads=2, tie=False, **overrides):
    """A tiny random Qwen3MoeForCausalLM written with save_pretrained; returns the HF model."""
    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=n_kv_heads,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        max_position_embeddings=64,
        norm_topk_prob=norm_topk_prob,
        tie_word_embeddings=tie,
        rope_theta=1e6,
        attn_implementation="eager",
        **overrides,
    )
    torch.manual_seed(0)
    hf_model = transformers.Qwen3MoeForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():  # HF's N(0, 0.02) init leaves the router near uniform
            p.normal_(0.0, 0.3)
    hf_model.save_pretrained(directory)
    return hf_model


def rewrite_expert_layout(src, dst, fused):
    """Copy a checkpoint directory, storing the experts per-expert (hub layout) or fused
    (E, 2I, D) / (E, D, I)."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    n_layers = json.load(open(os.path.join(src, "config.json")))["num_hidden_layers"]
    for i in range(n_layers):
        prefix = f"model.layers.{i}.mlp.experts"
        if f"{prefix}.gate_up_proj" not in tensors:  # per-expert on disk: fuse first
            n_experts = sum(
                k.startswith(f"{prefix}.") and k.endswith(".gate_proj.weight") for k in tensors
            )
            gate, up, down = (
                torch.stack([tensors.pop(f"{prefix}.{e}.{p}.weight") for e in range(n_experts)])
                for p in ("gate_proj", "up_proj", "down_proj")
            )
            tensors[f"{prefix}.gate_up_proj"] = torch.cat((gate, up), 1)
            tensors[f"{prefix}.down_proj"] = down
        if not fused:
            gate_up = tensors.pop(f"{prefix}.gate_up_proj")
            down = tensors.pop(f"{prefix}.down_proj")
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
    tokens = torch.arange(T)[:, None].expand_as(expert_ids)  # (T, A)
    dense_weights = torch.zeros(T, experts.n_experts)  # (T, E)
    dense_weights.index_put_((tokens, expert_ids), expert_weights, accumulate=True)
    y = torch.zeros(T, D)
    for e in range(experts.n_experts):
        gate, up = (x @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
        y += dense_weights[:, e : e + 1] * ((F.silu(gate) * up) @ experts.down_proj[e].T)
    return y


class ConcatKVCache:
    """The smallest object satisfying the cache contract: keeps every key/value, returns all of
    them."""

    def __init__(self, n_layers):
        self.keys = [None] * n_layers
        self.values = [None] * n_layers

    def update(self, layer_idx, k, v):
        if self.keys[layer_idx] is not None:
            k = torch.cat((self.keys[layer_idx], k), dim=2)
            v = torch.cat((self.values[layer_idx], v), dim=2)
        self.keys[layer_idx] = k
        self.values[layer_idx] = v
        return k, v


# ------------------------------------------------------------------------------------- Hugging Face
@pytest.mark.parametrize(
    "norm_topk_prob,n_kv_heads,tie",
    [
        (True, 2, False),
        (False, 2, False),
        (True, 4, False),
        (False, 4, False),
        (True, 2, True),
    ],
    ids=["normtopk-gqa", "nonorm-gqa", "normtopk-mha", "nonorm-mha", "normtopk-gqa-tied"],
)
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
    assert "model.layers.0.mlp.experts.*: incomplete" in message
    assert "layers.0.mlp.experts.down_proj" in message


# ------------------------------------------------------------------------------------------ experts
def test_sparse_experts_match_dense_all_expert_computation():
    torch.manual_seed(0)
    experts = Experts(tiny_config())
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(experts.down_proj, std=0.3)
    x = torch.randn(40, 64)
    # Experts 0 and 5 get no tokens (empty groups); some tokens repeat an expert, as forced
    # routes may.
    expert_ids = torch.tensor([1, 2, 3, 4, 6, 7])[torch.randint(6, (40, 2))]
    expert_weights = torch.rand(40, 2)
    max_diff, _ = report_diff(
        experts(x, expert_ids, expert_weights),
        dense_moe_reference(experts, x, expert_ids, expert_weights),
        "sparse vs dense",
    )
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
    # stable: token order within an expert
    assert routing.token_ids.tolist() == [0, 1, 3, 2, 1, 0, 2, 3]
    assert routing.counts.tolist() == [3, 1, 1, 3, 0]
    assert routing.offsets.tolist() == [3, 4, 5, 8, 8] and routing.offsets.dtype == torch.int32
    assert torch.equal(routing.order[routing.inverse_order], torch.arange(8))


# the widest uint8 sort key, and the int32 one beyond it
@pytest.mark.parametrize("n_experts", [256, 300])
def test_route_tokens_matches_a_stable_sort_oracle_for_every_key_width(n_experts):
    generator = torch.Generator().manual_seed(0)
    expert_ids = torch.randint(n_experts, (97, 8), generator=generator)
    # the largest ids sort last, 255 stays 255
    expert_ids[0, 0] = n_experts - 1
    expert_ids[1, 0] = 255
    routing = route_tokens(expert_ids, n_experts)
    flat = expert_ids.reshape(-1).tolist()
    order = sorted(range(len(flat)), key=lambda n: (flat[n], n))
    assert routing.order.tolist() == order
    assert routing.counts.tolist() == [flat.count(e) for e in range(n_experts)]
    assert routing.offsets.tolist() == list(
        itertools.accumulate(flat.count(e) for e in range(n_experts))
    )


@pytest.mark.cuda
def test_cuda_router_takes_the_fused_kernel_with_or_without_grad_and_chooses_torch_topks_experts():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # BF16 logits tie often (8 mantissa bits): the sets must still be torch.topk's, weights
    # fp32-close
    logits = (2 * torch.randn(4096, 128, device="cuda")).bfloat16()
    with torch.no_grad():
        weights, ids = moe.router_top_k(logits, 8, True)
    twin_weights, twin_ids = moe.router_top_k_reference(logits, 8, True)
    assert torch.equal(ids.sort(-1).values, twin_ids.sort(-1).values)
    by_id = weights.gather(-1, ids.argsort(-1))
    twin_by_id = twin_weights.gather(-1, twin_ids.argsort(-1))
    torch.testing.assert_close(by_id, twin_by_id, rtol=1e-6, atol=0)
    trained = moe.router_top_k(logits.float().requires_grad_(), 8, True)[0]
    assert type(trained.grad_fn).__name__ == "RouterTopKBackward"  # training takes it too


def test_sum_expert_rows_is_each_tokens_rows_added_in_order():
    # oracle: a float64 loop over tokens and their assignments, in the routing's own terms (order)
    generator = torch.Generator().manual_seed(5)
    T, A, D = 6, 3, 32
    routing = route_tokens(torch.randint(4, (T, A), generator=generator), 4)
    y_sorted = torch.randn(T * A, D, generator=generator)
    rows_of = {int(n): i for i, n in enumerate(routing.order)}  # assignment t*A + a -> sorted row
    oracle = torch.stack(
        [sum(y_sorted[rows_of[t * A + a]].double() for a in range(A)) for t in range(T)]
    )
    got = moe.sum_expert_rows(y_sorted, routing, A)
    torch.testing.assert_close(got.double(), oracle, rtol=1e-6, atol=1e-6)
    bf16 = moe.sum_expert_rows(y_sorted.bfloat16(), routing, A)  # one rounding, at the end
    from_fp32 = moe.sum_expert_rows(y_sorted.bfloat16().float(), routing, A).bfloat16()
    assert torch.equal(bf16, from_fp32)


@pytest.mark.cuda
def test_route_tokens_takes_the_counting_sort_on_cuda_for_a_decode_step(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    calls = []
    original = moe.routing_kernels.route_tokens
    monkeypatch.setattr(
        moe.routing_kernels, "route_tokens", lambda *a: calls.append(1) or original(*a)
    )
    for tokens, fused in ((256, True), (moe.routing_kernels.MAX_ASSIGNMENTS // 8 + 1, False)):
        calls.clear()
        expert_ids = torch.randint(128, (tokens, 8), device="cuda")
        routing = moe.route_tokens(expert_ids, 128)
        assert bool(calls) == fused
        assert all(
            torch.equal(a, b) for a, b in zip(routing, moe.route_tokens_reference(expert_ids, 128))
        )


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm not in this torch")
def test_grouped_mm_fast_path_matches_loop_twin_in_bf16_on_cpu():
    torch.manual_seed(0)
    E, D, I, N = 4, 64, 32, 48
    gate_up = torch.randn(E, 2 * I, D, dtype=torch.bfloat16, requires_grad=True)
    down = torch.randn(E, D, I, dtype=torch.bfloat16, requires_grad=True)
    expert_ids = torch.tensor([0, 0, 2, 3])[torch.randint(4, (N, 1))]  # expert 1 empty
    routing = route_tokens(expert_ids, E)
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
    assert (
        report_diff(fast, reference, "cuda grouped bf16 vs fp32")[0] < 2e-2 * reference.abs().max()
    )
    assert report_diff(fast_grad, reference_grad, "grad")[0] < 3e-2 * reference_grad.abs().max()


@pytest.mark.cuda
def test_rms_norm_takes_the_fused_kernel_on_cuda_and_matches_the_twin(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    norm = moe.RMSNorm(2048, 1e-6).cuda().to(torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(64, 1, 2048, device="cuda", dtype=torch.bfloat16)
    calls = []
    original = moe.norm_kernels.rms_norm
    monkeypatch.setattr(moe.norm_kernels, "rms_norm", lambda *a: calls.append(1) or original(*a))
    with torch.no_grad():
        y = norm(x)
    assert calls and y.dtype == torch.bfloat16
    expected = moe.rms_norm_reference(x, norm.weight, norm.eps)
    assert ((y.float() - expected.float()).abs() <= 2 * 2**-7 * expected.float().abs()).all()
    assert (y != expected).float().mean() < 0.01  # rarely one BF16 unit apart, never more


def test_norm_layers_route_fp16_to_their_torch_twins():
    x = torch.randn(2, 1, 4, 16).half()
    cos, sin = moe.rope_cos_sin(torch.zeros(2, 1, dtype=torch.long), 16, 1e6, torch.float16)
    norm = moe.RMSNorm(16, 1e-6).half()
    # on a GPU: the kernels' dtype check routes them
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, cos, sin, norm = x.to(device), cos.to(device), sin.to(device), norm.to(device)
    with torch.no_grad():
        assert torch.equal(norm(x), moe.rms_norm_reference(x, norm.weight, 1e-6))
        plain = moe.apply_rope(
            moe.rms_norm_reference(x, norm.weight, 1e-6).transpose(1, 2), cos, sin
        )
        assert torch.equal(moe.norm_rope(x, norm, cos, sin), plain)


def test_norm_rope_keeps_autograd_and_the_composition_off_cuda():
    attention = moe.Attention(moe.MoEConfig.from_preset("tiny"), 0)
    x = torch.randn(2, 3, attention.n_heads, attention.head_dim, requires_grad=True)
    cos, sin = moe.rope_cos_sin(torch.arange(3).expand(2, 3), attention.head_dim, 1e4, x.dtype)
    y = moe.norm_rope(x, attention.q_norm, cos, sin)
    assert torch.equal(y, moe.apply_rope(attention.q_norm(x).transpose(1, 2), cos, sin))
    y.sum().backward()
    assert x.grad is not None and attention.q_norm.weight.grad is not None


@pytest.mark.cuda
def test_attention_takes_the_fused_norm_rope_on_cuda_without_grad_and_matches_the_autograd_path(
    monkeypatch,
):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    config = moe.MoEConfig.from_preset("qwen3-30b-a3b", n_layers=1)
    attention = moe.Attention(config, 0).cuda().to(torch.bfloat16)
    for norm in (attention.q_norm, attention.k_norm):
        norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(8, 5, config.dim, device="cuda", dtype=torch.bfloat16)
    cos, sin = moe.rope_cos_sin(
        torch.randint(0, 4096, (8, 5), device="cuda"),
        config.head_dim,
        config.rope_theta,
        torch.bfloat16,
    )
    calls = []
    original = moe.norm_kernels.norm_rope
    monkeypatch.setattr(moe.norm_kernels, "norm_rope", lambda *a: calls.append(1) or original(*a))
    with torch.no_grad():
        fused = attention(x, cos, sin)
    assert len(calls) == 2  # queries and keys
    plain = attention(x.requires_grad_(), cos, sin)  # autograd: the norm module, then apply_rope
    assert len(calls) == 2 and torch.equal(fused, plain)


# ------------------------------------------------------------------------------------ routes, cache
def test_replaying_recorded_routes_reproduces_logits_exactly():
    model = random_model()
    tokens = torch.randint(48, (3, 16))
    logits, routes = model(tokens, return_routes=True)
    assert routes.shape == (2, 3, 16, 2) and routes.dtype == torch.int64
    replayed, replayed_routes = model(tokens, forced_routes=routes, return_routes=True)
    assert torch.equal(replayed, logits) and torch.equal(replayed_routes, routes)


def test_forced_routes_choose_the_experts_and_the_router_still_gets_gradients():
    model = random_model()
    tokens = torch.randint(48, (2, 12))
    # (L, B, T, A) distinct random experts
    forced = torch.rand(2, 2, 12, 8).argsort(dim=-1)[..., :2]
    # each router's output on the input it really got (after forced layers upstream)
    gate_logits = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, i, o: gate_logits.append(o.detach()))
        for layer in model.layers
    ]
    logits, routes = model(tokens, forced_routes=forced, return_routes=True)
    for hook in hooks:
        hook.remove()
    for layer_routes, g in zip(routes, gate_logits):  # the router's own top-k, not the replay
        own = g.float().softmax(-1).topk(2, dim=-1).indices.view(2, 12, 2)
        assert torch.equal(layer_routes.sort(-1).values, own.sort(-1).values)
    assert not torch.equal(routes.sort(-1).values, forced.sort(-1).values)
    # other experts than the router's top-k really ran
    assert not torch.allclose(logits, model(tokens))
    F.cross_entropy(logits.flatten(0, 1), torch.randint(48, (24,))).backward()
    for layer in model.layers:
        grad = layer.mlp.gate.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_prefill_then_decode_with_kv_cache_matches_full_forward():
    model = random_model()
    B, P, T = 2, 6, 10
    tokens = torch.randint(48, (B, T))
    full = model(tokens)
    cache = ConcatKVCache(model.config.n_layers)
    causal = torch.ones(P, P, dtype=torch.bool).tril()[None, None]  # (1, 1, P, P)
    prefill = model(
        tokens[:, :P], positions=torch.arange(P).expand(B, P), attn_mask=causal, kv_cache=cache
    )
    diffs = [report_diff(prefill, full[:, :P], "prefill")[0]]
    for t in range(P, T):
        step = model(
            tokens[:, t : t + 1],
            positions=torch.full((B, 1), t),
            kv_cache=cache,
            attn_mask=torch.ones(B, 1, 1, t + 1, dtype=torch.bool),
        )
        diffs.append(report_diff(step[:, 0], full[:, t], f"decode {t}")[0])
    assert cache.keys[0].shape == (B, model.config.n_kv_heads, T, model.config.head_dim)
    assert max(diffs) < 1e-5


# ------------------------------------------------------------------------------------------- config
def test_qwen3_30b_a3b_preset_has_the_published_parameter_counts():
    with torch.device("meta"):
        model = MoETransformer(MoEConfig.from_preset("qwen3-30b-a3b"))
    assert 30.0e9 < model.num_params() < 31.0e9  # "30.5B total"
    assert 3.2e9 < model.num_params(active=True) < 3.5e9  # "3.3B activated"


def test_swappable_layers_lists_attention_linears_and_experts_and_optionally_router_and_head():
    model = tiny_model(vocab_size=VOCAB)
    n_layers = model.config.n_layers
    default = moe.swappable_layers(model)
    assert sum(isinstance(m, moe.Experts) for _, _, m in default) == n_layers
    assert sorted({name for parent, name, m in default if isinstance(parent, moe.Attention)}) == [
        "k_proj",
        "o_proj",
        "q_proj",
        "v_proj",
    ]
    assert len(default) == 5 * n_layers
    everything = moe.swappable_layers(model, include_router=True, include_lm_head=True)
    assert len(everything) == 6 * n_layers + 1
    assert any(parent is model and name == "lm_head" for parent, name, _ in everything)


# ---------------------------------------------------------------------------------------- bad input
def _saved_config(directory, config):
    config.save_pretrained(directory)
    return str(directory)


def _forward(**kwargs):
    tokens = kwargs.pop("tokens", torch.randint(VOCAB, (2, 5)))
    return tiny_model(vocab_size=VOCAB)(tokens, **kwargs)


BAD_CALLS = [  # (id, call given a scratch directory, what the message names, the problem it states)
    (
        "heads",
        lambda tmp: tiny_config(n_heads=6, n_kv_heads=4),
        "n_heads=6",
        "not divisible by n_kv_heads=4",
    ),
    ("active", lambda tmp: tiny_config(n_active=9), "n_active=9", "exceeds n_experts=8"),
    ("head_dim", lambda tmp: tiny_config(head_dim=15), "head_dim=15", "must be even"),
    ("vocab", lambda tmp: tiny_config(vocab_size=0), "vocab_size", "positive int"),
    ("theta", lambda tmp: tiny_config(rope_theta=0.0), "rope_theta", "positive"),
    ("preset", lambda tmp: MoEConfig.from_preset("huge"), "'huge'", "qwen3-30b-a3b"),
    (
        "1-D tokens",
        lambda tmp: _forward(tokens=torch.zeros(10, dtype=torch.long)),
        "tokens",
        "(B, T), got (10,)",
    ),
    ("float tokens", lambda tmp: _forward(tokens=torch.zeros(2, 5)), "tokens", "integer"),
    (
        "too long",
        lambda tmp: _forward(tokens=torch.zeros(1, 65, dtype=torch.long)),
        "max_seq_len=64",
        "exceed",
    ),
    ("cache alone", lambda tmp: _forward(kv_cache=ConcatKVCache(2)), "kv_cache", "attn_mask"),
    (
        "expert rows",
        lambda tmp: moe.sum_expert_rows(
            torch.zeros(5, 4), route_tokens(torch.zeros(3, 2, dtype=torch.long), 4), 2
        ),
        "y_sorted (5, 4)",
        "N = 6",
    ),
    ("float mask", lambda tmp: _forward(attn_mask=torch.zeros(2, 1, 5, 5)), "attn_mask", "bool"),
    (
        "positions",
        lambda tmp: _forward(positions=torch.zeros(2, 4, dtype=torch.long)),
        "positions",
        "(2, 5)",
    ),
    (
        "routes shape",
        lambda tmp: _forward(forced_routes=torch.zeros(2, 5, 2, dtype=torch.long)),
        "forced_routes",
        "(L, B, T, A)",
    ),
    (
        "routes ids",
        lambda tmp: _forward(forced_routes=torch.full((2, 2, 5, 2), 8)),
        "forced_routes",
        "[0, 8)",
    ),
    (
        "llama",
        lambda tmp: load_hf(
            _saved_config(
                tmp,
                transformers.LlamaConfig(
                    hidden_size=32, num_hidden_layers=1, num_attention_heads=4
                ),
            )
        ),
        "model_type",
        "'llama'",
    ),
    (
        "features",
        lambda tmp: load_hf(
            _saved_config(
                tmp, transformers.Qwen3MoeConfig(mlp_only_layers=[0], attention_bias=True)
            )
        ),
        "mlp_only_layers",
        "attention_bias",
    ),
    (
        "no weights",
        lambda tmp: load_hf(_saved_config(tmp, transformers.Qwen3MoeConfig())),
        "*.safetensors",
        "no ",
    ),
]


@pytest.mark.parametrize(
    "call, names, problem", [case[1:] for case in BAD_CALLS], ids=[case[0] for case in BAD_CALLS]
)
def test_bad_input_raises_one_line_naming_the_field_and_the_problem(tmp_path, call, names, problem):
    raises_one_line(lambda: call(tmp_path), names, problem)


def test_target_log_probs_and_entropies_are_the_float64_softmaxs(monkeypatch):
    """forward(targets=..., return_entropy=True), in chunks of 5 positions: each position's
    log-prob of its target and entropy H = -sum p log p of softmax(logits / temperature), against a
    float64 oracle on the whole logits; the entropy carries no gradient."""
    torch.manual_seed(0)
    model = moe.MoETransformer(moe.MoEConfig.from_preset("tiny", vocab_size=96))
    tokens = torch.randint(96, (3, 11))
    targets = torch.randint(96, (3, 11))
    with torch.no_grad():
        z = model(tokens).double() / 0.7
    log_p = torch.log_softmax(z, dim=-1)
    expected_logp = log_p.gather(-1, targets[..., None]).squeeze(-1)
    expected_entropy = -(log_p.exp() * log_p).sum(-1)
    monkeypatch.setattr(moe, "LOGPROB_CHUNK_ELEMENTS", 96 * 5)
    logp, entropy = model(tokens, targets=targets, temperature=0.7, return_entropy=True)
    assert report_diff(logp.double(), expected_logp, "log-probs")[0] < 1e-5
    assert report_diff(entropy.double(), expected_entropy, "entropies")[0] < 1e-5
    assert logp.requires_grad and not entropy.requires_grad
