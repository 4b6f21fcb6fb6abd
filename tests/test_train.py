"""End-to-end tests of train.py on the CPU: tiny model, a few RL steps per recipe."""
import json
import os

import pytest
import torch

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
    assert all(r["mismatch/tis_ratio_max"] <= 2.0 and "tis_weight_mean" in r for r in records)


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


# ----------------------------------------------------------------------------- torchrun (gloo, 2 CPU processes)
TORCHRUN_ARGS = ["--recipe", "bf16", "--difficulty", "1", "--warmstart-steps", "100", "--prompts-per-step", "5",
                 "--group-size", "4", "--eval-prompts", "9", "--eval-every", "3", "--checkpoint-every", "1",
                 "--lr", "1e-3", "--device", "cpu"]
COMPARED = ("reward", "loss", "grad_norm", "completion_len", "pass@1", "pass@1_bf16_trainer",
            "mismatch/trainer_ppl", "mismatch/rollout_ppl")


def _train_py(out_dir, *extra, nproc=0):
    """train.py in a fresh process, under torchrun with nproc ranks (nproc=0: plain python)."""
    import subprocess
    import sys
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc else [sys.executable]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(launcher + [os.path.join(repo, "train.py"), *TORCHRUN_ARGS, "--out-dir", str(out_dir),
                                        *extra], capture_output=True, text=True, env=env, cwd=repo, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return os.path.join(str(out_dir), "bf16")


def _same_run(a, b, steps, rel=1e-5):
    """Metrics of the steps in `steps` and the final weights agree to fp32 reduction-order tolerance."""
    ma = {r["step"]: r for r in read_metrics(a)}
    mb = {r["step"]: r for r in read_metrics(b)}
    for step in steps:
        for key in COMPARED:
            if key in ma[step]:
                assert ma[step][key] == pytest.approx(mb[step][key], rel=rel, abs=1e-6), (step, key)
    wa = torch.load(os.path.join(a, "checkpoint.pt"), weights_only=True)
    wb = torch.load(os.path.join(b, "checkpoint.pt"), weights_only=True)
    assert wa["step"] == wb["step"]
    for name, weight in wa["trainer"].items():
        torch.testing.assert_close(wb["trainer"][name], weight, atol=1e-5, rtol=1e-4, msg=name)


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory):
    """The reference: one process, 3 steps of 5 prompts x 4 samples; its warm-start cache is reused."""
    out = tmp_path_factory.mktemp("single")
    run_dir = _train_py(out, "--steps", "3")
    assert any(r.get("grad_norm", 0) > 0 for r in read_metrics(run_dir))   # the steps do learn something
    return out, run_dir


def _with_warmstart(single_out, tmp_path):
    import shutil
    shutil.copytree(os.path.join(single_out, "warmstart"), tmp_path / "warmstart")
    return tmp_path


def test_shards_cover_every_item_once_in_order():
    for n in (1, 5, 8, 13):
        for world in (1, 2, 3, 8):
            spans = [train.shard(n, train.Distributed(rank, world)) for rank in range(world)]
            assert [i for start, stop in spans for i in range(start, stop)] == list(range(n))
            sizes = [stop - start for start, stop in spans]
            assert max(sizes) - min(sizes) <= 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_give_the_single_process_run(single_process_run, tmp_path, mode):
    """Same global batch (5 groups: shards of 3 and 2, so the token-mean loss must be weighted right):
    same rewards, losses, gradient norms, pass@1 and final weights as one process."""
    single_out, single_dir = single_process_run
    extra = ["--fsdp"] if mode == "fsdp" else []
    run_dir = _train_py(_with_warmstart(single_out, tmp_path), "--steps", "3", *extra, nproc=2)
    _same_run(single_dir, run_dir, steps=(0, 1, 2, 3))


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_in_one_process(single_process_run, tmp_path):
    single_out, single_dir = single_process_run
    out = _with_warmstart(single_out, tmp_path)
    _train_py(out, "--steps", "2", nproc=2)
    run_dir = _train_py(out, "--steps", "3", "--resume")
    _same_run(single_dir, run_dir, steps=(1, 2, 3))
