"""tools/memory.py: the plan's terms against hand-computed values for a tiny config, its activation
count against what autograd saves on the CPU, and the flags it names when a plan does not fit."""

import dataclasses

import pytest
import torch
from conftest import raises_one_line

import moe
import symmetric
import rac
from tools import memory

# D 32, L 2, H 4, Hkv 2, hd 8, E 4, A 2, I 16, V 48
CONFIG = moe.MoEConfig(
    vocab_size=48,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    n_experts=4,
    n_active=2,
    expert_dim=16,
)
# 2 prompts x 2 samples, 10 prompt + 20 completion tokens: 4 rows of 30 tokens
LAYOUT = memory.Layout(prompts=2, group_size=2, prompt_tokens=10, completion_tokens=20)

# Counted by hand. A block: q 32*32 + k 32*16 + v 32*16 + o 32*32 = 3072 attention, 3*4*32*16 =
# 6144 experts, 32*4 = 128 router, 2*32 + 2*8 = 80 norms: 9424. Root: 48*32 embedding and as
# much LM head, 32 final norm: 3104.
BLOCK, ROOT = 9424, 3104
P = 2 * BLOCK + ROOT  # 21952
Q = 2 * (3072 + 6144)  # 18432, what the rollout quantizes
LINEAR = 2 * (3072 + 128) + 48 * 32  # 7936: projections, routers, LM head
EXPERTS = 2 * 6144  # 12288
# Saved bytes a token and layer (the module docstring's a): 16*32 + 2*8*(4+2) + (8*8*4 + 4*4) +
# (2*4 + 8*2) + 2*(4*32 + 8*16 + 18) = 512 + 96 + 272 + 24 + 548; f = 6*32
PER_LAYER, PER_FORWARD = 1452, 192


def test_parameter_counts_match_the_hand_count_and_the_model():
    counts = memory.parameter_counts(CONFIG)
    assert counts == (P, Q, BLOCK, ROOT, LINEAR, EXPERTS)
    for tie in (False, True):
        config = dataclasses.replace(CONFIG, tie_embeddings=tie)
        with torch.device("meta"):
            model = moe.MoETransformer(config)
        assert memory.parameter_counts(config).total == model.num_params() == P - tie * 48 * 32
        quantized = sum(
            sum(p.numel() for p in child.parameters())
            for _, _, child in moe.swappable_layers(model)
        )
        assert memory.parameter_counts(config).quantized == quantized == Q


def test_plan_of_one_gpu_against_hand_computed_bytes():
    plan = memory.plan(CONFIG, LAYOUT)
    tokens = 4 * 30
    # slots: the 10-token prompt padded to 16, plus 20, rounded up to 48; a slot holds keys and
    # values of 2 layers x 2 heads x 8 dims in BF16: 128 bytes; 4 rows
    kv_cache = 48 * 128 * 4
    expected = dict(
        trainer_weights=4 * P,
        gradients=4 * P,
        optimizer=8 * P,
        rollout_model=0.5625 * Q + 2 * (P - Q),  # 10368 + 7040
        eval_copy=2 * P,
        reference_model=0,
        kv_cache=kv_cache,
        activations=tokens * (2 * PER_LAYER + PER_FORWARD),
        activations_other=tokens * (2 * 4 * 32 + PER_LAYER + PER_FORWARD),
        logits=14 * 48 * tokens,
        weight_casts=2 * (LINEAR + EXPERTS),
        qat_weights=0,
        gathered=0,
        optimizer_step=4 * P,
    )
    assert dataclasses.asdict(plan) == pytest.approx(expected)
    held = 16 * P + 17408 + 2 * P + kv_cache
    training_pass = (
        tokens * (2 * PER_LAYER + PER_FORWARD) + 14 * 48 * tokens + 2 * (LINEAR + EXPERTS)
    )
    assert plan.total() == pytest.approx(held + max(training_pass, 4 * P))
    assert "total" in plan.table(1e9) and "fits in 90% of the 1.00 GB free" in plan.table(1e9)


def test_checkpointing_micro_batches_chunks_qat_and_precision_change_their_terms():
    def of(**changes):
        return memory.plan(CONFIG, dataclasses.replace(LAYOUT, **changes))

    checkpointed = of(grad_checkpoint=True)
    assert checkpointed.activations == 120 * (2 * 4 * 32 + PER_LAYER + PER_FORWARD)
    assert checkpointed.weight_casts == 2 * (LINEAR + EXPERTS / 2)  # one block's experts
    micro = of(micro_batch=1)  # one row of 30 tokens a forward
    assert micro.activations == 30 * (2 * PER_LAYER + PER_FORWARD)
    assert micro.logits == 14 * 48 * 30
    assert of(minibatches=2).activations == 60 * (2 * PER_LAYER + PER_FORWARD)
    assert of(logprob_chunk=8).logits == 14 * 48 * 8
    assert of(trainer_mode="qat").qat_weights == 4 * Q
    # checkpointed, a block's fake-quantized weights live only while it is recomputed
    assert of(trainer_mode="qat", grad_checkpoint=True).qat_weights == 4 * Q / 2
    assert of(rollout_precision="bf16").rollout_model == 2 * P
    assert of(rollout_precision="w16a4").rollout_model == 4.5625 * Q + 2 * (P - Q)
    assert of(eval_copy=False).eval_copy == 0
    assert of().reference_model == 0 and of(reference_model=True).reference_model == 2 * P
    # 3 held-out prompts: one more row each in the evaluation's own cache
    assert of(eval_prompts=3).kv_cache == 48 * 128 * (4 + 3)


def test_fsdp_shards_the_trainer_and_ddp_adds_its_buckets():
    fsdp = memory.plan(CONFIG, dataclasses.replace(LAYOUT, world_size=2, fsdp=True))
    assert fsdp.trainer_weights == fsdp.gradients == 4 * P / 2
    assert fsdp.optimizer == 8 * P / 2 and fsdp.optimizer_step == 4 * P / 2
    assert fsdp.gathered == 4 * ROOT + 12 * BLOCK
    assert fsdp.rollout_model == 0.5625 * Q + 2 * (P - Q)  # whole on every rank
    assert fsdp.kv_cache == 48 * 128 * 2  # one prompt x 2 samples a rank
    ddp = memory.plan(CONFIG, dataclasses.replace(LAYOUT, world_size=2))
    assert ddp.trainer_weights == 4 * P and ddp.gradients == 8 * P and ddp.gathered == 0


class SavedBytes:
    """Bytes autograd saves for backward (each storage once)."""

    def __init__(self):
        self.storages, self.bytes = set(), 0

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.storages:
            self.storages.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return tensor


def saved_bytes_of_a_block(config, tokens):
    torch.manual_seed(0)
    block = moe.Block(config, 0)
    for p in block.parameters():  # wide enough that every expert is routed some tokens
        torch.nn.init.normal_(p, 0.0, 0.3)
    x = torch.randn(1, tokens, config.dim, requires_grad=True)
    positions = torch.arange(tokens)[None]
    cos, sin = moe.rope_cos_sin(positions, config.head_dim, config.rope_theta, torch.float32)
    saved = SavedBytes()
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t),
    ):
        block(x, cos, sin)
    return saved.bytes


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(dim=64, n_heads=8, n_kv_heads=2, n_experts=8, n_active=4, expert_dim=48)],
    ids=["tiny", "wider"],
)
def test_activation_count_matches_what_autograd_saves_on_the_cpu(overrides):
    """The CPU runs the torch twins (fused=False); the slope between two lengths leaves out what
    does not grow with the tokens (the weights' BF16 casts)."""
    config = dataclasses.replace(CONFIG, **overrides)
    short, long = saved_bytes_of_a_block(config, 64), saved_bytes_of_a_block(config, 192)
    measured = (long - short) / 128
    per_layer, _ = memory.activation_bytes_per_token(config, fused=False)
    print(f"saved bytes a token: measured {measured:.0f}, counted {per_layer}")
    assert per_layer == pytest.approx(measured, rel=0.06)


def test_fitting_flags_names_the_fewest_flags_that_fit():
    layout = dataclasses.replace(LAYOUT, prompts=8, group_size=8, completion_tokens=500)
    plan = memory.plan(CONFIG, layout)
    assert memory.fitting_flags(CONFIG, layout, plan.total() / memory.FIT_FRACTION + 1) is None
    free = (plan.held() + 0.25 * plan.training_pass()) / memory.FIT_FRACTION
    line = memory.fitting_flags(CONFIG, layout, free)
    assert "\n" not in line and f"needs {memory.gb(plan.total())} a GPU (activations" in line
    flags = line.split("it fits with ")[1].split(" (")[0].split()
    assert "--prompts-per-step" not in flags  # fewer rows only when nothing else fits

    def apply(flags):
        changes, words = {}, iter(flags)
        for word in words:
            if word == "--grad-checkpoint":
                changes["grad_checkpoint"] = True
            elif word == "--micro-batch":
                changes["micro_batch"] = int(next(words))
        return dataclasses.replace(layout, **changes)

    assert memory.plan(CONFIG, apply(flags)).fits(free)
    if "--grad-checkpoint" in flags:  # both flags needed: checkpointing alone does not fit
        assert not memory.plan(CONFIG, apply(["--grad-checkpoint"])).fits(free)
    if "--micro-batch" in flags:  # and the micro-batch is the largest that fits
        rows = int(flags[flags.index("--micro-batch") + 1])
        larger = [word if word != str(rows) else str(2 * rows) for word in flags]
        assert not memory.plan(CONFIG, apply(larger)).fits(free)


def test_fitting_flags_adds_checkpointing_before_it_takes_prompts_away():
    """16 rows with long KV caches: one row a forward is not enough, checkpointed it is; one prompt
    alone would fit too (a smaller cache), but changes the experiment, so it comes last."""
    layout = dataclasses.replace(LAYOUT, prompts=16, group_size=1, completion_tokens=4000)
    one_row = memory.plan(CONFIG, dataclasses.replace(layout, micro_batch=1))
    both = memory.plan(CONFIG, dataclasses.replace(layout, micro_batch=1, grad_checkpoint=True))
    free = (one_row.total() + both.total()) / 2 / memory.FIT_FRACTION
    assert both.fits(free) and not one_row.fits(free)
    assert memory.plan(CONFIG, dataclasses.replace(layout, prompts=1)).fits(free)
    line = memory.fitting_flags(CONFIG, layout, free)
    assert line.endswith(
        f"it fits with --grad-checkpoint --micro-batch 1 ({memory.gb(both.total())})"
    )


def test_fitting_flags_prefers_fsdp_and_says_when_nothing_fits():
    layout = dataclasses.replace(LAYOUT, world_size=4, prompts=4)
    plan = memory.plan(CONFIG, layout)
    sharded = memory.plan(CONFIG, dataclasses.replace(layout, fsdp=True))
    free = (plan.total() + sharded.total()) / 2 / memory.FIT_FRACTION
    assert sharded.total() < plan.total()
    assert memory.fitting_flags(CONFIG, layout, free).endswith(
        f"it fits with --fsdp ({memory.gb(sharded.total())})"
    )
    line = memory.fitting_flags(CONFIG, layout, 1000.0)
    assert "nothing tried fits" in line and "more GPUs, or a smaller model" in line
    # the smallest plan names only flags that change this layout: it has no evaluation copy to drop
    no_copy = dataclasses.replace(layout, eval_copy=False)
    line = memory.fitting_flags(CONFIG, no_copy, 1000.0)
    assert "--fsdp" in line and "--no-eval-trainer" not in line


def test_fitting_flags_drops_the_evaluation_copy_before_it_takes_prompts_away():
    """Qwen3-30B-A3B on 8 GPUs of 141 GB, already sharded, checkpointed and in micro-batches: the
    BF16 evaluation copy (2 bytes a parameter on every GPU) is what does not fit."""
    config = moe.MoEConfig.from_preset("qwen3-30b-a3b")
    layout = memory.Layout(
        prompts=64,
        completion_tokens=1024,
        world_size=8,
        fsdp=True,
        grad_checkpoint=True,
        micro_batch=8,
        trainer_mode="qat",
        logprob_chunk=moe.logprob_chunk_tokens(config.vocab_size),
    )
    with_copy = memory.plan(config, layout)
    without = memory.plan(config, dataclasses.replace(layout, eval_copy=False))
    assert with_copy.total() - without.total() == 2 * memory.parameter_counts(config).total
    line = memory.fitting_flags(config, layout, 141e9)
    assert line.endswith(f"it fits with --no-eval-trainer ({memory.gb(without.total())})"), line


def test_max_layers_is_the_last_that_fits():
    layout = dataclasses.replace(LAYOUT, completion_tokens=200)
    free = memory.plan(dataclasses.replace(CONFIG, n_layers=5), layout).total() / 0.9 + 1
    assert memory.max_layers(CONFIG, layout, free) == 5
    assert memory.max_layers(CONFIG, layout, 1.0) == 0


def test_modes_are_rac_and_the_trainers_modes():
    assert tuple(memory.ROLLOUT_BYTES) == rac.MODES
    assert memory.TRAINER_MODES == ("bf16", "qat") + symmetric.MODES


@pytest.mark.parametrize(
    "field,value,problem",
    [
        ("prompts", 0, "must be an integer >= 1, got 0"),
        ("micro_batch", -1, "must be an integer >= 0, got -1"),
        ("rollout_precision", "fp4", "must be one of bf16, fp8, nvfp4, w4a16, w16a4, got 'fp4'"),
        ("trainer_mode", "int8", "must be one of bf16, qat, w4a4, moeresq, trace, got 'int8'"),
    ],
)
def test_layout_refuses_bad_values_in_one_line(field, value, problem):
    raises_one_line(lambda: memory.Layout(**{field: value}), f"Layout.{field}", problem)


def test_command_line_prints_the_plan_and_the_flags(capsys):
    result = memory.main(["--preset", "small", "--prompts", "4", "--gpu-gb", "0.5"])
    out = capsys.readouterr().out
    assert isinstance(result, memory.Plan) and "trainer weights" in out
    assert "the memory plan needs" in out and "the most layers of these shapes that fit" in out


def test_command_line_chunks_the_log_probs_as_train_py_does():
    # Qwen3's vocabulary: 441 positions a chunk (moe.logprob_chunk_tokens), not the whole forward's
    result = memory.main(["--prompts", "8", "--completion-tokens", "1024"])
    assert result.logits == 14 * 151_936 * 441
    whole = memory.main(["--prompts", "8", "--completion-tokens", "1024", "--logprob-chunk", "0"])
    assert whole.logits == 14 * 151_936 * 64 * (256 + 1024)
