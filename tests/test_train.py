"""End-to-end tests of train.py on the CPU: tiny model, a few RL steps per recipe."""
import copy
import json
import os
import random

import pytest
import torch

import grpo
import qat
import rac
import rollout
import train


def tiny_config(out_dir, **overrides):
    settings = dict(preset="tiny", difficulty=2, steps=3, prompts_per_step=4, group_size=4, warmstart_steps=40,
                    warmstart_batch=32, eval_prompts=16, eval_every=3, checkpoint_every=2, out_dir=str(out_dir),
                    device="cpu", seed=0)
    settings.update(overrides)
    return train.TrainConfig(**settings)


def read_metrics(run_dir, rl_steps_only=False):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if r["step"] > 0] if rl_steps_only else records


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def recipe_runs(out_dir):
    """bf16, nvfp4 and quads from one cached warm-start (the first run writes it, the others load it)."""
    torch.set_num_threads(1)
    return {recipe: train.run(tiny_config(out_dir, recipe=recipe)) for recipe in ("bf16", "nvfp4", "quads")}


def test_every_recipe_writes_metrics_checkpoint_and_figure(recipe_runs):
    for recipe, run_dir in recipe_runs.items():
        records = read_metrics(run_dir)
        assert [r["step"] for r in records] == [0, 1, 2, 3]
        assert set(records[0]) == {"step", "pass@1", "pass@1_bf16_trainer"}  # the warm-started baseline
        records = records[1:]
        for key in ("reward", "loss", "mismatch/abs_diff_mean", "mismatch/abs_diff_max", "mismatch/kl_k3",
                    "routing_disagreement", "rollout_tokens_per_s"):
            assert key in records[0], f"{recipe}: {key} missing"
        assert "pass@1" in records[-1] and "pass@1_bf16_trainer" in records[-1]
        assert 0.0 <= records[-1]["pass@1"] <= 1.0
        assert os.path.exists(os.path.join(run_dir, "checkpoint.pt"))
        assert os.path.exists(os.path.join(run_dir, "curves.png"))
        with open(os.path.join(run_dir, "config.json")) as f:
            assert json.load(f)["recipe"] == recipe


def test_bf16_mismatch_is_near_zero_and_nvfp4_clearly_above(recipe_runs):
    bf16 = max(r["mismatch/abs_diff_max"] for r in read_metrics(recipe_runs["bf16"], rl_steps_only=True))
    nvfp4 = min(r["mismatch/abs_diff_mean"] for r in read_metrics(recipe_runs["nvfp4"], rl_steps_only=True))
    print(f"bf16 max |dlogp| {bf16:.2e}; nvfp4 mean |dlogp| {nvfp4:.2e}")
    assert bf16 < 1e-4          # same fp32 weights, cached vs cache-free forward: rounding only
    assert nvfp4 > 100 * bf16   # W4A4 rollout against a BF16 trainer
    assert nvfp4 > 1e-3


def test_bf16_routes_agree_and_nvfp4_routes_sometimes_differ(recipe_runs):
    assert max(r["routing_disagreement"] for r in read_metrics(recipe_runs["bf16"], rl_steps_only=True)) < 0.01
    assert max(r["routing_disagreement"] for r in read_metrics(recipe_runs["nvfp4"], rl_steps_only=True)) > 0.0


def test_resumed_run_reproduces_the_next_step(out_dir):
    full = read_metrics(train.run(tiny_config(out_dir, recipe="quads", run_name="resume_full")))
    train.run(tiny_config(out_dir, recipe="quads", run_name="resume_part", steps=2))
    resumed = read_metrics(train.run(tiny_config(out_dir, recipe="quads", run_name="resume_part", resume=True)))
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for key in ("reward", "loss", "mismatch/abs_diff_mean", "grad_norm"):
        assert resumed[3][key] == full[3][key], key


def test_non_finite_loss_stops_the_run_and_keeps_the_checkpoint(out_dir, monkeypatch):
    run_dir = train.run(tiny_config(out_dir, recipe="bf16", run_name="nan_run", steps=2))
    before = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)["step"]
    real_loss = train.grpo.policy_loss

    def poisoned(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(train.grpo, "policy_loss", poisoned)
    with pytest.raises(FloatingPointError, match="non-finite loss"):
        train.run(tiny_config(out_dir, recipe="bf16", run_name="nan_run", steps=4, resume=True))
    assert torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)["step"] == before


def test_compare_variants_set_recipe_rac_ratio_tis_and_r3():
    assert train.parse_variant("quads@0.25") == {"recipe": "quads", "rac_ratio": 0.25}
    assert train.parse_variant("nvfp4+tis2+r3") == {"recipe": "nvfp4", "tis": 2.0, "r3": True}
    cfg = train.TrainConfig(device="cpu", **train.parse_variant("rac@0.125+tis3"))
    assert cfg.run_name == "rac@0.125+tis3"
    assert train.TrainConfig(device="cpu", recipe="quads").run_name == "quads"  # the default ratio stays unnamed
    with pytest.raises(ValueError, match="cannot read variant 'quads@x'"):
        train.parse_variant("quads@x")
    with pytest.raises(ValueError, match="cannot read variant 'quads\\+fast'"):
        train.parse_variant("quads+fast")


def test_compare_with_jobs_runs_variants_in_processes_and_matches_the_sequential_runs(recipe_runs, out_dir):
    # same warm-start cache (same out_dir and settings) and seeds: the parallel runs repeat recipe_runs exactly
    settings = tiny_config(out_dir)
    flags = [f"--{k.replace('_', '-')}={getattr(settings, k)}" for k in
             ("preset", "difficulty", "steps", "prompts_per_step", "group_size", "warmstart_steps", "warmstart_batch",
              "eval_prompts", "eval_every", "checkpoint_every", "device", "seed")]
    parallel_dir = os.path.join(out_dir, "jobs")
    os.makedirs(os.path.join(parallel_dir, "warmstart"))
    for name in os.listdir(os.path.join(out_dir, "warmstart")):  # reuse the module's warm-start
        os.link(os.path.join(out_dir, "warmstart", name), os.path.join(parallel_dir, "warmstart", name))
    run_dirs = train.main(flags + ["--out-dir", parallel_dir, "--compare", "bf16,nvfp4", "--jobs", "2"])
    assert [os.path.basename(d) for d in run_dirs] == ["bf16", "nvfp4"]
    for recipe, run_dir in zip(("bf16", "nvfp4"), run_dirs):
        parallel, sequential = read_metrics(run_dir, True), read_metrics(recipe_runs[recipe], True)
        assert [r["reward"] for r in parallel] == [r["reward"] for r in sequential]
        assert [r["mismatch/abs_diff_max"] for r in parallel] == [r["mismatch/abs_diff_max"] for r in sequential]
    with open(os.path.join(parallel_dir, "compare.md")) as f:
        assert [line.split("|")[1].strip() for line in f.read().splitlines()[2:]] == ["bf16", "nvfp4"]


def test_cli_builds_the_config_from_the_dataclass():
    cfg = train.parse_args(["--recipe", "nvfp4", "--tis", "2", "--r3", "--steps", "7", "--device", "cpu"])
    assert (cfg.recipe, cfg.tis, cfg.r3, cfg.steps) == ("nvfp4", 2.0, True, 7)
    assert cfg.run_name == "nvfp4+tis2+r3"


@pytest.mark.parametrize("flags, message", [
    (["--recipe", "int3"], "--recipe must be one of"),
    (["--compare", "bf16,fp2"], "unknown recipe 'fp2'"),
    (["--rac-ratio", "1.5"], "rac-ratio"),
    (["--group-size", "1"], "group-size"),
    (["--jobs", "0"], "--jobs"),
])
def test_bad_config_values_raise_clear_errors(flags, message):
    with pytest.raises(ValueError, match=message):
        train.parse_args(flags + ["--device", "cpu"])


def test_ctrl_c_saves_a_checkpoint_of_the_last_finished_step(out_dir, monkeypatch):
    calls = {"n": 0}
    real = train.grpo.group_advantages

    def interrupt_on_second_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train.grpo, "group_advantages", interrupt_on_second_step)
    with pytest.raises(SystemExit) as stop:
        train.run(tiny_config(out_dir, recipe="bf16", run_name="ctrl_c", steps=3, checkpoint_every=100))
    assert stop.value.code == 130
    ckpt = torch.load(os.path.join(out_dir, "ctrl_c", "checkpoint.pt"), weights_only=True)
    assert ckpt["step"] == 1


def test_a_hugging_face_checkpoint_trains_on_a_local_gsm8k_file(tmp_path):
    """--model with --task gsm8k: a tiny random Qwen3-MoE and a character tokenizer saved in Hugging
    Face format, GSM8K-format problems from a local jsonl file; two RL steps of the quads recipe."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials + list("0123456789+-*=#.,?!:() \nabcdefghijklmnopqrstuvwxyz"
                                                                   "ABCDEFGHIJKLMNOPQRSTUVWXYZ\"'<>/"))}
    char_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    char_level.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    char_level.decoder = tokenizers.decoders.Fuse()  # join characters without spaces
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=char_level, eos_token="<eos>",
                                                        pad_token="<pad>", unk_token="<unk>")
    model_dir = tmp_path / "model"
    hf_tokenizer.save_pretrained(model_dir)
    config = transformers.Qwen3MoeConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(model_dir)
    data = tmp_path / "gsm8k.jsonl"
    with open(data, "w") as f:
        for a in range(40):
            f.write(json.dumps({"question": f"What is {a}+2?", "answer": f"{a}+2={a + 2}\n#### {a + 2}"}) + "\n")

    cfg = train.TrainConfig(model=str(model_dir), task="gsm8k", task_source=str(data), recipe="quads", steps=2,
                            prompts_per_step=2, group_size=2, warmstart_steps=2, warmstart_batch=2, eval_prompts=2,
                            max_new_tokens=8, out_dir=str(tmp_path / "runs"), device="cpu")
    records = read_metrics(train.run(cfg))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(0.0 <= r["reward"] <= 1.0 for r in records[1:])
    tokenizer = train.HFTokenizer(hf_tokenizer)
    assert tokenizer.decode(tokenizer.encode("#### 42") + [tokenizer.eos_id] + tokenizer.encode("x")) == "#### 42"


@pytest.mark.parametrize("recipe", ["fp8", "qat", "rac", "w4a4"])
def test_the_other_recipes_run_end_to_end(out_dir, recipe):
    records = read_metrics(train.run(tiny_config(out_dir, recipe=recipe, steps=2, eval_every=2)), rl_steps_only=True)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["mismatch/abs_diff_mean"] > 1e-4  # every one of them rolls out in low precision


def test_route_replay_removes_routing_disagreement_and_tis_logs_truncation(out_dir):
    cfg = tiny_config(out_dir, recipe="nvfp4", r3=True, tis=2.0, steps=2, eval_every=2)
    assert cfg.run_name == "nvfp4+tis2+r3"
    records = read_metrics(train.run(cfg), rl_steps_only=True)
    assert all(r["routing_disagreement"] == 0.0 for r in records)  # the trainer ran the rollout's experts
    assert all(r["mismatch/tis_ratio_max"] <= 2.0 and "mismatch/tis_clip_frac" in r for r in records)


def test_summary_table_has_a_row_per_run_with_its_mismatch(recipe_runs):
    table = train.summarize(list(recipe_runs.values()))
    lines = table.splitlines()
    assert len(lines) == 2 + len(recipe_runs)
    assert "mean abs dlogp @ 3" in lines[0] and "rollout tok/s" in lines[0]
    nvfp4_row = next(line for line in lines if line.startswith("| nvfp4 |"))
    mean_gap = float(nvfp4_row.split("|")[3])
    assert mean_gap == pytest.approx(sum(r["mismatch/abs_diff_mean"] for r in read_metrics(
        recipe_runs["nvfp4"], rl_steps_only=True)) / 3, rel=1e-2)


def test_plot_smoothing_is_a_trailing_mean_that_starts_with_fewer_values():
    assert train.smooth([1.0, 3.0, 5.0, 7.0], 2) == pytest.approx([1.0, 2.0, 4.0, 6.0])
    assert train.smooth([2.0, 4.0], 10) == pytest.approx([2.0, 3.0])
    assert train.smooth([5.0, 1.0], 1) == [5.0, 1.0]


# ----------------------------------------------------------------------------- mini-batches, MIPU, the audit
def update_fixture(**overrides):
    """A random tiny QAT trainer, one batch its NVFP4 rollout sampled (4 prompts x 4 samples), advantages of
    both signs, and the run's AdamW."""
    cfg = tiny_config("unused", recipe="quads", lr=1e-2, **overrides)
    task = train.build_task(cfg)
    model, tokenizer = train.build_model(cfg, task)
    rollout_model = rac.convert_for_rollout(copy.deepcopy(model), "nvfp4")
    trainer = qat.convert_for_training(model, "qat")
    prompts = train.encode_prompts(tokenizer, task.sample(4, "train", random.Random(0)))
    seq = rollout.generate(rollout_model, prompts, 4, 12, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                           seed=0).sequences()
    advantages = torch.randn(16, generator=torch.Generator().manual_seed(0))
    return cfg, trainer, seq, advantages


def adamw(cfg, model):
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99))


def test_one_minibatch_is_the_plain_on_policy_update_bit_for_bit():
    cfg, trainer, seq, advantages = update_fixture(tis=2.0)
    reference = copy.deepcopy(trainer)
    old, _, stats = train.policy_update(cfg, trainer, adamw(cfg, trainer), seq, advantages, shuffle_seed=0)
    # the update before mini-batches existed: one forward, old = its own detached log-probs, one step
    optimizer = adamw(cfg, reference)
    logp = grpo.token_logprobs(reference(seq.tokens)[:, :-1].float(), seq.tokens[:, 1:])
    loss, _ = grpo.policy_loss(logp, logp.detach(), advantages, seq.loss_mask[:, 1:], cfg.clip_low,
                               cfg.clip_high, rollout_logprobs=seq.logprobs[:, 1:], tis_cap=2.0)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.grad_clip)
    optimizer.step()
    assert torch.equal(old, logp.detach()) and len(stats) == 1 and stats[0]["loss"] == loss.item()
    for (name, updated), expected in zip(trainer.named_parameters(), reference.parameters()):
        assert torch.equal(updated, expected), name
    assert stats[0]["ratio/min"] == stats[0]["ratio/max"] == 1.0 and stats[0]["clip_ratio/region_mean"] == 0.0


def test_several_minibatches_move_the_ratio_after_the_first_and_the_clip_responds_to_clip_high():
    clipped_high = {}
    for clip_high in (1e-3, 10.0):
        cfg, trainer, seq, advantages = update_fixture(minibatches=4, clip_high=clip_high)
        with torch.no_grad():
            sampling_weights_logp, _ = train.trainer_logprobs(cfg, trainer, seq)
        old, _, stats = train.policy_update(cfg, trainer, adamw(cfg, trainer), seq, advantages, 0)
        assert torch.equal(old, sampling_weights_logp)  # old: before the first step, not after
        assert len(stats) == 4
        print(clip_high, [(round(s["ratio/min"], 4), round(s["ratio/max"], 4)) for s in stats])
        assert 1 - 1e-5 < stats[0]["ratio/min"] <= stats[0]["ratio/max"] < 1 + 1e-5  # the sampling weights
        assert all(s["ratio/max"] - s["ratio/min"] > 1e-3 for s in stats[1:])
        clipped_high[clip_high] = [s["clip_ratio/high_mean"] for s in stats]
    assert clipped_high[1e-3][0] == 0.0 and sum(clipped_high[1e-3][1:]) > 0.0
    assert sum(clipped_high[10.0]) == 0.0


def test_update_metrics_average_over_minibatches_and_keep_the_extremes():
    stats = [{"loss": 1.0, "grad_norm": 2.0, "ratio/mean": 1.0, "ratio/min": 1.0, "ratio/max": 1.0,
              "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0,
              "approx_kl": 0.0},
             {"loss": 3.0, "grad_norm": 4.0, "ratio/mean": 1.2, "ratio/min": 0.5, "ratio/max": 3.0,
              "clip_ratio/low_mean": 0.1, "clip_ratio/high_mean": 0.3, "clip_ratio/region_mean": 0.4,
              "approx_kl": 0.2}]
    record = train.update_metrics(tiny_config("unused", minibatches=2), stats)
    assert record == pytest.approx({"loss": 2.0, "grad_norm": 3.0, "ratio/mean": 1.1, "ratio/min": 0.5,
                                    "ratio/max": 3.0, "clip_ratio/low_mean": 0.05, "clip_ratio/high_mean": 0.15,
                                    "clip_ratio/region_mean": 0.2, "approx_kl": 0.1})
    assert train.update_metrics(tiny_config("unused"), stats[:1]) == {"loss": 1.0, "grad_norm": 2.0}


def test_on_policy_runs_log_no_ratio_statistics(recipe_runs):
    record = read_metrics(recipe_runs["quads"], rl_steps_only=True)[0]
    assert not any(key.startswith(("ratio/", "clip_ratio/", "approx_kl", "mipu/")) for key in record)


@pytest.mark.parametrize("proxy", [-1.0, 1.0])
def test_mipu_keeps_an_accepted_candidate_and_restores_a_rejected_one(out_dir, monkeypatch, proxy):
    monkeypatch.setattr(train.grpo, "mipu_proxy", lambda *args: proxy)
    # the short warm-start rarely solves a problem: advantages of both signs, so that every update moves
    generator = torch.Generator().manual_seed(0)
    monkeypatch.setattr(train.grpo, "group_advantages",
                        lambda rewards, G: torch.randn(len(rewards), generator=generator))
    # what the rollout model computes on a fixed probe, each time it samples (steps and evaluations)
    outputs, real_generate, probe = {}, train.rollout.generate, torch.tensor([[1, 2, 3, 4, 5, 6]])

    def recording_generate(model, *args, **kwargs):
        with torch.no_grad():
            outputs.setdefault(id(model), []).append(model(probe))
        return real_generate(model, *args, **kwargs)

    monkeypatch.setattr(train.rollout, "generate", recording_generate)
    cfg = tiny_config(out_dir, recipe="quads", mipu=True, steps=2, eval_every=2, run_name=f"mipu{proxy:+g}")
    records = read_metrics(train.run(cfg))
    rollout_outputs = next(iter(outputs.values()))  # the rollout model samples first (the step-0 evaluation)
    assert len(rollout_outputs) == 4  # evaluation, two steps, evaluation
    rollout_unchanged = [torch.equal(output, rollout_outputs[0]) for output in rollout_outputs]
    checkpoint = torch.load(os.path.join(out_dir, cfg.run_name, "checkpoint.pt"), weights_only=True)
    task = train.build_task(cfg)
    warm = train.warmstart(cfg, train.build_model(cfg, task)[0], task, None).state_dict()
    unchanged = [torch.equal(checkpoint["trainer"][name], warm[name]) for name in warm]
    assert [r["mipu/accept_rate"] for r in records[1:]] == ([0.0, 0.0] if proxy < 0 else [1.0, 1.0])
    assert all("ratio/mean" in r and "mipu/trainer_proxy" in r for r in records[1:])
    if proxy < 0:  # weights, optimizer state and the rollout model: as before the first candidate
        assert all(unchanged) and checkpoint["optimizer"]["state"] == {} and all(rollout_unchanged)
    else:
        assert not all(unchanged) and len(checkpoint["optimizer"]["state"]) > 0
        assert not all(rollout_unchanged[2:])


def test_audit_scores_one_batch_three_ways_per_recipe(recipe_runs):
    table_path = train.main(["--audit", recipe_runs["quads"], "--audit-recipes", "bf16,nvfp4",
                             "--device", "cpu"])
    with open(os.path.join(recipe_runs["quads"], "audit.json")) as f:
        results = json.load(f)["recipes"]
    bf16, nvfp4 = results["bf16"], results["nvfp4"]
    # fp32 rollout and trainer: decode, prefill and the trainer agree up to summation order
    assert bf16["A-B"]["abs_diff_max"] < 1e-4 and bf16["B-C"]["abs_diff_max"] < 1e-4
    # NVFP4: a token's activation scale depends on its batch (A-B), and FP4 against a BF16 trainer (B-C)
    assert nvfp4["A-B"]["abs_diff_mean"] > 1e-3 and nvfp4["B-C"]["abs_diff_mean"] > 1e-3
    assert bf16["B-B replay max"] == nvfp4["B-B replay max"] == 0.0  # one prefill is repeatable
    with open(table_path) as f:
        rows = [line for line in f.read().splitlines() if line.startswith("| ") and "recipe" not in line
                and not line.startswith("| ---")]
    assert [row.split("|")[1].strip() for row in rows] == ["bf16", "nvfp4"]
    assert float(rows[1].split("|")[4]) == pytest.approx(nvfp4["A-B"]["abs_diff_mean"], rel=1e-2)  # A-B MAE
    batch = torch.load(os.path.join(recipe_runs["quads"], "audit_batch_nvfp4.pt"), weights_only=True)
    mask = batch["loss_mask"][:, 1:]
    assert (batch["A"] - batch["B"])[mask].abs().mean().item() == pytest.approx(nvfp4["A-B"]["abs_diff_mean"])
    # a checkpoint file works as well as its run directory, and gives the same batch
    train.main(["--audit", os.path.join(recipe_runs["quads"], "checkpoint.pt"), "--audit-recipes", "nvfp4",
                "--device", "cpu"])
    assert torch.equal(torch.load(os.path.join(recipe_runs["quads"], "audit_batch_nvfp4.pt"),
                                  weights_only=True)["tokens"], batch["tokens"])


@pytest.mark.parametrize("flags, message", [
    (["--minibatches", "0"], "--minibatches must be in"),
    (["--minibatches", "129"], r"--minibatches must be in \[1, prompts x group size = 128\]"),
    (["--mipu", "--tis", "2"], "--mipu takes its ratios against the rollout"),
    (["--audit-recipes", "bf16,int3"], "--audit-recipes: unknown recipe 'int3'"),
])
def test_bad_update_and_audit_options_raise_clear_errors(flags, message):
    with pytest.raises(ValueError, match=message):
        train.parse_args(flags + ["--device", "cpu"])


def test_audit_of_a_missing_checkpoint_says_so(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint there"):
        train.main(["--audit", str(tmp_path), "--device", "cpu"])


def test_minibatches_and_mipu_name_the_run():
    cfg = train.TrainConfig(device="cpu", recipe="nvfp4", minibatches=4, mipu=True)
    assert cfg.run_name == "nvfp4+mb4+mipu"
