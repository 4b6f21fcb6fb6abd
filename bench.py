"""Measured speed of the project's kernels, layers and rollout against their baselines.

    python bench.py quantize        # nvfp4 quantize kernel vs a device-to-device copy
    python bench.py model           # moe.py forward+backward tokens/s (BF16, eager and compiled)
    python bench.py gemm            # rac.py W4A4 dense/grouped GEMMs vs FP8 and BF16
    python bench.py qat             # qat.py training step time: bf16 vs qat vs w4a4
    python bench.py rollout         # rollout.py sampler vs HF generate; decode tokens/s per precision

Each subcommand prints a markdown table (GPU, shapes, median times) that goes into the README as is.
Timings use CUDA events through `triton.testing.do_bench` (median), after warm-up; inputs are random,
never zeros. Bandwidth figures count the bytes each op must read plus write, divided by the measured
time, and are set beside a device-to-device copy measured in the same run.
"""
import argparse
import subprocess
import sys

import torch


def gpu_header():
    """One line naming the GPU, torch/triton versions and git commit, printed above every table."""
    import triton
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # not a git checkout (e.g. a copied tree): say so rather than guess
        commit = "unknown"
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"device: {name} | torch {torch.__version__} | triton {triton.__version__} | commit {commit}"


def bench_ms(fn, warmup=25, rep=100):
    """Median milliseconds of fn() with CUDA events (triton.testing.do_bench)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth(nbytes=1 << 30):
    """Measured device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


# ---------------------------------------------------------------------------- quantize (nvfp4.py)
def bench_quantize(args):
    """Quantize kernel bandwidth against a device-to-device copy of the same BF16 input.

    Bytes counted: the kernel reads x once (2 B/elem) and writes codes (0.5 B) and E4M3 block scales
    (1/16 B). `quantize` with a computed global scale first reads x once more for amax (torch): its
    row counts the logical bytes only, so the extra pass shows as lost bandwidth, not hidden.
    """
    import nvfp4
    rows = []
    for n in (8192, 16384):
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        numel = x.numel()
        dst = torch.empty_like(x)
        copy_ms = bench_ms(lambda: dst.copy_(x))
        copy_bw = 4 * numel / (copy_ms * 1e-3)
        gs = nvfp4.compute_global_scale(x)
        q_bytes = 2 * numel + numel // 2 + numel // 16
        for name, fn, nbytes in [
            ("copy (reference)", lambda: dst.copy_(x), 4 * numel),
            ("quantize kernel, given global scale", lambda: nvfp4.quantize(x, gs), q_bytes),
            ("quantize incl. amax pass", lambda: nvfp4.quantize(x), q_bytes),
            ("amax pass alone", lambda: nvfp4.compute_global_scale(x), 2 * numel),
            ("fake_quantize kernel, given global scale", lambda: nvfp4.fake_quantize(x, gs), 4 * numel),
            ("dequantize kernel", lambda q=nvfp4.quantize(x, gs): nvfp4.dequantize(q), q_bytes),
        ]:
            ms = bench_ms(fn)
            bw = nbytes / (ms * 1e-3)
            rows.append((f"{n}x{n}", name, ms * 1e3, bw / 1e9, 100 * bw / copy_bw))
        del x, dst
    print("| shape | op | time (us) | GB/s | % of copy |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.0f} | {r[4]:.0f}% |")


# ---------------------------------------------------------------------------- model (moe.py)
def bench_model(args):
    """Forward+backward tokens/s of the "small" preset in BF16 on a random training batch, eager vs compiled."""
    import torch.nn.functional as F
    from moe import MoEConfig, MoETransformer

    config = MoEConfig.from_preset("small")
    batch, seq = 32, 256
    torch.manual_seed(0)
    model = MoETransformer(config).to(device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(config.vocab_size, (batch, seq + 1), device="cuda")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def train_step(forward):
        model.zero_grad(set_to_none=True)
        logits = forward(inputs)
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()

    compiled = torch.compile(model)
    train_step(compiled)  # compile outside the timed region
    print(f"\nmoe.py forward+backward, preset small ({model.num_params() / 1e6:.0f}M params, "
          f"{model.num_params(active=True) / 1e6:.0f}M active; D={config.dim} L={config.n_layers} "
          f"E={config.n_experts} A={config.n_active} I={config.expert_dim} V={config.vocab_size}), "
          f"BF16, batch {batch} x {seq} tokens, median of do_bench\n")
    print("| mode | ms / step | tokens/s |")
    print("| --- | ---: | ---: |")
    for mode, forward in (("eager", model), ("torch.compile", compiled)):
        ms = bench_ms(lambda: train_step(forward), warmup=200, rep=1000)
        print(f"| {mode} | {ms:.2f} | {batch * seq / (ms * 1e-3):,.0f} |")


# ---------------------------------------------------------------------------- gemm (rac.py)
def bench_gemm(args):
    raise NotImplementedError


# ---------------------------------------------------------------------------- qat (qat.py)
def bench_qat(args):
    """Training step time (forward + backward + AdamW step) of moe.py's "small" preset, BF16 weights,
    under each of qat.py's modes: bf16 (the reference), qat (fake-quantized weights, recomputed once per
    step because every step changes them), w4a4 (weights and activations fake-quantized), and w4a4 with
    residual compensation on half the channel blocks. Loss: cross-entropy on random tokens.
    """
    import copy

    import torch.nn.functional as F

    import moe
    import qat
    preset, batch, seq_len = "small", 32, 256
    config = moe.MoEConfig.from_preset(preset)
    torch.manual_seed(0)
    base = moe.MoETransformer(config).cuda().bfloat16()
    tokens = torch.randint(config.vocab_size, (batch, seq_len + 1), device="cuda")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    rows = []
    for label, mode, rac_ratio in [("bf16", "bf16", 0.0), ("qat", "qat", 0.0), ("w4a4", "w4a4", 0.0),
                                   ("w4a4, rac_ratio 0.5", "w4a4", 0.5)]:
        model = qat.convert_for_training(copy.deepcopy(base), mode, rac_ratio=rac_ratio)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def train_step():
            loss = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        ms = bench_ms(train_step, warmup=500, rep=3000)  # do_bench budgets are in ms: tens of steps
        rows.append((label, ms))
        del model, optimizer
        torch.cuda.empty_cache()

    n_params = sum(p.numel() for p in base.parameters())
    print(f"\nTraining step (fwd + bwd + AdamW), preset {preset!r} ({n_params / 1e6:.0f}M params, "
          f"vocab {config.vocab_size}, BF16 weights), "
          f"batch {batch} x {seq_len} tokens, median of CUDA-event timings\n")
    print("| mode | step (ms) | tokens/s | vs bf16 |")
    print("| --- | ---: | ---: | ---: |")
    for label, ms in rows:
        print(f"| {label} | {ms:.2f} | {batch * seq_len / (ms * 1e-3):,.0f} | {ms / rows[0][1]:.2f}x |")


# ---------------------------------------------------------------------------- rollout (rollout.py)
def bench_rollout(args):
    """(a) rollout.generate against Hugging Face `generate` on one checkpoint; (b) decode tokens/s per precision.

    (a) A random "small"-preset Qwen3-MoE (vocab 32768) is built with transformers, saved with
        save_pretrained, and loaded by both sides (moe.load_hf / from_pretrained), BF16. 16 prompts of 32..63
        random tokens x 16 samples = 256 sequences x 128 new tokens, temperature 1, no top-k/top-p, no EOS
        (every row makes all 128 tokens). HF samples with num_return_sequences=16 (each prompt prefilled 16
        times, its default dynamic cache, its default attention and experts implementations). Time: whole
        call, prefill included, median of 3 after one warm-up (ours captures its CUDA graph in the warm-up).
    (b) Qwen3-30B-A3B layer shapes (D 2048, 32/4 heads of 128, 128 experts of 768, top-8), 4 layers, vocab
        32768, random weights, converted by rac.convert_for_rollout. Decode rate = B * 128 / (t(144 new
        tokens) - t(16 new tokens)): the difference cancels prefill and per-call costs. B prompts of 64
        tokens, 1 sample each, temperature 1, no EOS; context 80..208 tokens.
    """
    _bench_rollout_vs_hf()
    try:
        import rac
    except ImportError as error:  # rac.py not written or not importable: part (b) needs it
        print(f"\nskipping decode tokens/s per precision: rac.py is not importable ({error})")
        return
    _bench_decode_per_precision(rac)


def _time_generate(model, prompts, num_samples, max_new_tokens, repeats=3):
    """Median wall seconds of rollout.generate (one warm-up call first), and the last Rollout."""
    import statistics
    import time
    import rollout
    out = rollout.generate(model, prompts, num_samples, max_new_tokens, seed=0)  # warm-up: pool, graph capture
    times = []
    for seed in range(1, repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = rollout.generate(model, prompts, num_samples, max_new_tokens, seed=seed)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _bench_rollout_vs_hf(n_prompts=16, num_samples=16, max_new_tokens=128, vocab_size=32768):
    import statistics
    import tempfile
    import time
    import transformers
    import moe
    import rollout

    c = moe.MoEConfig.from_preset("small", vocab_size=vocab_size)
    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=4 * c.dim, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        num_experts=c.n_experts, num_experts_per_tok=c.n_active, moe_intermediate_size=c.expert_dim,
        max_position_embeddings=c.max_seq_len, norm_topk_prob=c.norm_topk_prob, rms_norm_eps=c.rms_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=c.tie_embeddings)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        transformers.Qwen3MoeForCausalLM(hf_config).save_pretrained(directory)
        model, _ = moe.load_hf(directory, dtype=torch.bfloat16)
        hf = transformers.Qwen3MoeForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    model, hf = model.cuda().eval(), hf.cuda().eval()
    hf.generation_config.eos_token_id = None

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(32, 64, (n_prompts,), generator=generator).tolist()
    prompts = [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in lengths]
    width = max(lengths)
    input_ids = torch.zeros(n_prompts, width, dtype=torch.int64)
    attention_mask = torch.zeros(n_prompts, width, dtype=torch.int64)
    for p, prompt in enumerate(prompts):  # left padding, as HF expects for decoder-only generation
        input_ids[p, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[p, width - len(prompt):] = 1
    input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()

    def hf_generate():
        return hf.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0,
                           top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                           num_return_sequences=num_samples, pad_token_id=0)

    with torch.no_grad():
        out = hf_generate()  # warm-up
        assert out.shape == (n_prompts * num_samples, width + max_new_tokens), out.shape
        hf_times = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            hf_generate()
            torch.cuda.synchronize()
            hf_times.append(time.perf_counter() - start)
    hf_seconds = statistics.median(hf_times)
    ours_seconds, ours = _time_generate(model, prompts, num_samples, max_new_tokens)
    assert ours.completion_ids.shape == (n_prompts * num_samples, max_new_tokens)

    # Same checkpoint, same numbers: greedy continuations of the first prompts agree (BF16 rounding may
    # flip a near-tie late in a row, so this is reported, not asserted).
    check = 16
    greedy = rollout.generate(model, prompts[:4], 1, check, temperature=0.0)
    with torch.no_grad():
        hf_greedy = hf.generate(input_ids=input_ids[:4], attention_mask=attention_mask[:4], do_sample=False,
                                max_new_tokens=check, min_new_tokens=check, pad_token_id=0)[:, width:]
    agreement = (greedy.completion_ids == hf_greedy).float().mean().item()

    tokens = n_prompts * num_samples * max_new_tokens
    print(f"\n### rollout: {n_prompts} prompts x {num_samples} samples x {max_new_tokens} new tokens, BF16, "
          f'"small" preset (D {c.dim}, {c.n_layers} layers, {c.n_experts} experts top-{c.n_active}, '
          f"vocab {vocab_size}), prompts of 32..63 tokens, temperature 1, no EOS")
    print(f"HF: transformers {transformers.__version__}, attention {hf.config._attn_implementation}, "
          f"experts {getattr(hf.config, '_experts_implementation', 'n/a')}, dynamic cache; greedy tokens equal to "
          f"ours on 4 prompts x {check} tokens: {100 * agreement:.0f}%")
    print("| sampler | time (s) | tokens/s | vs HF generate |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| HF transformers generate | {hf_seconds:.2f} | {tokens / hf_seconds:,.0f} | 1.00x |")
    graph = "CUDA graph" if ours.used_cuda_graph else "eager"
    print(f"| rollout.generate ({graph}) | {ours_seconds:.2f} | {tokens / ours_seconds:,.0f} | "
          f"{hf_seconds / ours_seconds:.2f}x (target >= 5x) |")
    del model, hf
    torch.cuda.empty_cache()


def _bench_decode_per_precision(rac, batches=(64, 256), prompt_len=64, short=16, long=144, vocab_size=32768):
    import copy
    import moe
    import rollout

    config = moe.MoEConfig.from_preset("qwen3-30b-a3b", n_layers=4, vocab_size=vocab_size, max_seq_len=1024)
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = moe.MoETransformer(config).to(torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, vocab_size, (max(batches), prompt_len), generator=generator).tolist()

    variants = [("moe.py BF16 (not converted)", None, 0.0), ("rac bf16", "bf16", 0.0), ("rac fp8", "fp8", 0.0),
                ("rac nvfp4", "nvfp4", 0.0), ("rac nvfp4 + RAC 0.5", "nvfp4", 0.5)]
    rates = {}  # (name, batch) -> decode tokens/s
    rows = []
    for name, mode, rac_ratio in variants:
        model = copy.deepcopy(base)
        try:
            if mode is not None:
                rac.convert_for_rollout(model, mode, rac_ratio=rac_ratio)
            for batch in batches:
                t_short, _ = _time_generate(model, prompts[:batch], 1, short)
                t_long, out = _time_generate(model, prompts[:batch], 1, long)
                rates[name, batch] = batch * (long - short) / (t_long - t_short)
                step_ms = 1e3 * (t_long - t_short) / (long - short)
                rows.append((name, batch, step_ms, rates[name, batch], out.used_cuda_graph))
        except Exception as error:  # report the failing variant and keep measuring the others
            rows.append((name, None, None, None, f"failed: {type(error).__name__}: {error}"))
        rollout.free_decode_states(model)
        del model
        torch.cuda.empty_cache()

    print(f"\n### decode tokens/s per precision: Qwen3-30B-A3B layer shapes, {config.n_layers} layers, "
          f"vocab {vocab_size}, random weights; prompts of {prompt_len} tokens, 1 sample each; "
          f"rate = B * {long - short} / (t({long} new) - t({short} new))")
    print("| rollout layers | batch | ms / decode step | decode tokens/s | CUDA graph |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name, batch, step_ms, rate, graph in rows:
        if batch is None:
            print(f"| {name} | - | - | - | {graph} |")
        else:
            print(f"| {name} | {batch} | {step_ms:.2f} | {rate:,.0f} | {'yes' if graph else 'no (eager)'} |")

    b = batches[0]
    checks = [("rac nvfp4 / rac fp8", "rac nvfp4", "rac fp8", 1.2), ("rac nvfp4 / rac bf16", "rac nvfp4", "rac bf16", 1.8),
              ("rac nvfp4 + RAC 0.5 / rac nvfp4", "rac nvfp4 + RAC 0.5", "rac nvfp4", 1 / 1.15)]
    print(f"\n| speed ratio at batch {b} | measured | target |")
    print("| --- | ---: | ---: |")
    for label, fast, slow, target in checks:
        if (fast, b) in rates and (slow, b) in rates:
            ratio = rates[fast, b] / rates[slow, b]
            print(f"| {label} | {ratio:.2f}x | >= {target:.2f}x {'(met)' if ratio >= target else '(NOT met)'} |")
        else:
            print(f"| {label} | not measured | >= {target:.2f}x |")


COMMANDS = {
    "quantize": bench_quantize,
    "model": bench_model,
    "gemm": bench_gemm,
    "qat": bench_qat,
    "rollout": bench_rollout,
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=list(COMMANDS), nargs="+")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.py measures GPU speed and needs CUDA; none is available here.")
    print(gpu_header())
    for name in args.what:
        COMMANDS[name](args)
