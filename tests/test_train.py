"""train.py end to end on the CPU (tiny model, a few RL steps per recipe), its command line, and the
checks that the loop really does RL: rollout weights synced from the trainer, rewards reaching the
loss through the right groups, a step that raises the advantage-weighted log-prob of what was
sampled."""

import copy
import dataclasses
import hashlib
import itertools
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time

import datasets
import pytest
import tokenizers
import torch
import transformers

import grpo
import moe
import nvfp4
import qat
import rac
import rollout
import symmetric
import train
from conftest import report_diff
from tools import runs

TINY = dict(
    preset="tiny",
    difficulty=1,
    steps=3,
    prompts_per_step=4,
    group_size=4,
    warmstart_steps=150,
    warmstart_batch=32,
    eval_prompts=16,
    eval_every=3,
    checkpoint_every=2,
    device="cpu",
    seed=0,
)


def log_softmax_gather(logits, tokens):
    """The oracle for a model's token log-probs: one log-softmax over the whole vocabulary in fp32,
    then each position's token (not moe.py's chunked logit-minus-logsumexp)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def tiny_config(out_dir, **overrides):
    return train.TrainConfig(**{**TINY, **in_dir(out_dir), **overrides})


def in_dir(out_dir):
    """A test's runs and warm-start cache, both under its own out_dir."""
    return {"out_dir": str(out_dir), "warmstart_dir": os.path.join(str(out_dir), "warmstart")}


def cli(out_dir, **overrides):
    """The command line of tiny_config(out_dir, **overrides)."""
    flags = []
    for name, value in {**TINY, **in_dir(out_dir), **overrides}.items():
        flag = "--" + name.replace("_", "-")
        flags += (
            [flag]
            if value is True
            else [f"--no-{flag[2:]}"]
            if value is False
            else [flag, str(value)]
        )
    return flags


def read_metrics(run_dir, rl_steps_only=False):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if r["step"] > 0] if rl_steps_only else records


def tree_digest(path):
    """{relative path: sha1 of the content} of every file under path: equal before and after =
    untouched."""
    digest = {}
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                digest[os.path.relpath(os.path.join(root, name), path)] = hashlib.sha1(
                    f.read()
                ).hexdigest()
    return digest


def main_exit(argv, capsys):
    """train.main in-process -> (exit code, stdout, stderr); a traceback would fail the test
    itself."""
    try:
        train.main(argv)
        code = 0
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def recipe_runs(out_dir):
    """bf16, nvfp4 and quads from one cached warm-start (the first run writes it, the others load
    it)."""
    return {
        recipe: train.run(tiny_config(out_dir, recipe=recipe))
        for recipe in ("bf16", "nvfp4", "quads")
    }


@pytest.mark.slow
def test_every_recipe_writes_metrics_and_checkpoint(recipe_runs):
    for recipe, run_dir in recipe_runs.items():
        records = read_metrics(run_dir)
        assert [r["step"] for r in records] == [0, 1, 2, 3]
        assert set(records[0]) == {
            "step",
            "pass@1",
            "pass@1_bf16_trainer",
        }  # the warm-started baseline
        records = records[1:]
        for key in (
            "reward",
            "loss",
            "mismatch/abs_diff_mean",
            "mismatch/abs_diff_max",
            "mismatch/kl_k3",
            "routing_disagreement",
            "rollout_tokens_per_s",
        ):
            assert key in records[0], f"{recipe}: {key} missing"
        assert "pass@1" in records[-1] and "pass@1_bf16_trainer" in records[-1]
        assert os.path.exists(os.path.join(run_dir, "checkpoint.pt"))
        assert not os.path.exists(
            os.path.join(run_dir, "curves.png")
        )  # figures: python -m tools.plot
        with open(os.path.join(run_dir, "config.json")) as f:
            assert json.load(f)["recipe"] == recipe


@pytest.mark.slow
def test_logged_pass_at_1_is_that_of_the_checkpointed_weights(recipe_runs, out_dir):
    """A fresh setup from the final checkpoint, evaluated again, gives the logged pass@1 of both
    models (the evaluation runs on the weights it claims to, and pass@1 is a count over
    eval_prompts)."""
    last = read_metrics(recipe_runs["nvfp4"])[-1]
    s = train.setup(tiny_config(out_dir, recipe="nvfp4", resume=True))
    assert s.start_step == 3
    assert train.evaluate_both(s) == {
        "pass@1": last["pass@1"],
        "pass@1_bf16_trainer": last["pass@1_bf16_trainer"],
    }
    assert (last["pass@1"] * TINY["eval_prompts"]).is_integer()


@pytest.mark.slow
def test_bf16_mismatch_is_near_zero_and_nvfp4_clearly_above(recipe_runs):
    bf16 = max(
        r["mismatch/abs_diff_max"] for r in read_metrics(recipe_runs["bf16"], rl_steps_only=True)
    )
    nvfp4 = min(
        r["mismatch/abs_diff_mean"] for r in read_metrics(recipe_runs["nvfp4"], rl_steps_only=True)
    )
    print(f"bf16 max |dlogp| {bf16:.2e}; nvfp4 mean |dlogp| {nvfp4:.2e}")
    assert bf16 < 1e-4  # same fp32 weights, cached vs cache-free forward: rounding only
    assert nvfp4 > 100 * bf16  # W4A4 rollout against a BF16 trainer
    assert nvfp4 > 1e-3


@pytest.mark.slow
def test_bf16_routes_agree_and_nvfp4_routes_sometimes_differ(recipe_runs):
    bf16_records, nvfp4_records = (
        read_metrics(recipe_runs[recipe], rl_steps_only=True) for recipe in ("bf16", "nvfp4")
    )
    assert max(r["routing_disagreement"] for r in bf16_records) < 0.01
    assert max(r["routing_disagreement"] for r in nvfp4_records) > 0.0


@pytest.mark.slow
def test_resumed_run_reproduces_the_next_step(out_dir, capsys):
    full = read_metrics(train.run(tiny_config(out_dir, recipe="quads", run_name="resume_full")))
    train.run(tiny_config(out_dir, recipe="quads", run_name="resume_part", steps=2))
    capsys.readouterr()
    resumed = read_metrics(
        train.run(tiny_config(out_dir, recipe="quads", run_name="resume_part", resume=True))
    )
    assert (
        f"resume_part: 3 steps; RL steps 3-3 took {resumed[3]['step_s']:.0f} s (resumed at step 2)"
        in capsys.readouterr().out
    )
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for key in ("reward", "loss", "mismatch/abs_diff_mean", "grad_norm"):
        assert resumed[3][key] == full[3][key], key


@pytest.mark.slow
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


def test_cli_builds_the_config_from_the_dataclass():
    cfg = train.parse_args(
        ["--recipe", "nvfp4", "--tis", "2", "--r3", "--steps", "7", "--device", "cpu"]
    )
    assert (cfg.recipe, cfg.tis, cfg.r3, cfg.steps) == ("nvfp4", 2.0, True, 7)
    assert cfg.run_name == "nvfp4+tis2+r3"


@pytest.mark.slow
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
        train.run(
            tiny_config(out_dir, recipe="bf16", run_name="ctrl_c", steps=3, checkpoint_every=100)
        )
    assert stop.value.code == 130
    ckpt = torch.load(os.path.join(out_dir, "ctrl_c", "checkpoint.pt"), weights_only=True)
    assert ckpt["step"] == 1


def test_ctrl_c_during_the_warm_start_is_one_line_and_a_clean_exit(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(
        train.torch.nn.utils, "clip_grad_norm_", interrupted
    )  # inside the warm-start loop
    code, out, err = main_exit(cli(tmp_path, recipe="bf16"), capsys)
    assert code == 130 and "Traceback" not in err  # (above the line: the warm-start's progress bar)
    last_line = err.strip().splitlines()[-1]
    assert last_line.startswith("interrupted before the first RL step: no checkpoint written")
    assert not os.path.exists(runs.warmstart_path(tiny_config(tmp_path)))  # nothing half-written


def _ctrl_c_during_the_second_update(monkeypatch, presses):
    """Send SIGINT `presses` times from inside step 2's weight sync, after its optimizer step."""
    import signal

    real = train.sync

    def sync_then_interrupt(s, step):
        real(s, step)
        if step == 2:  # the sync to the weights of step 2 (the rollout model's first is step 0's)
            for _ in range(presses):
                os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(train, "sync", sync_then_interrupt)


@pytest.mark.slow
def test_ctrl_c_during_an_update_finishes_logs_and_saves_that_step(out_dir, monkeypatch):
    _ctrl_c_during_the_second_update(monkeypatch, presses=1)
    saved = {}
    real_save = train.save

    def save_and_remember(s, step):  # the trainer's weights when each checkpoint is written
        saved[step] = {k: v.clone() for k, v in s.trainer.state_dict().items()}
        real_save(s, step)

    monkeypatch.setattr(train, "save", save_and_remember)
    with pytest.raises(SystemExit) as stop:
        train.run(
            tiny_config(out_dir, recipe="bf16", run_name="held", steps=3, checkpoint_every=100)
        )
    assert stop.value.code == 130
    ckpt = torch.load(os.path.join(out_dir, "held", "checkpoint.pt"), weights_only=True)
    logged = [
        json.loads(line)["step"] for line in open(os.path.join(out_dir, "held", "metrics.jsonl"))
    ]
    assert (
        ckpt["step"] == 2 and logged[-1] == 2 and list(saved) == [2]
    )  # step 2 finished, logged, saved
    assert all(torch.equal(ckpt["trainer"][k], v) for k, v in saved[2].items())


@pytest.mark.slow
def test_a_second_ctrl_c_during_an_update_stops_at_once_without_saving_it(out_dir, monkeypatch):
    _ctrl_c_during_the_second_update(monkeypatch, presses=2)
    with pytest.raises(SystemExit) as stop:
        train.run(
            tiny_config(out_dir, recipe="bf16", run_name="twice", steps=3, checkpoint_every=100)
        )
    assert stop.value.code == 130
    assert not os.path.exists(
        os.path.join(out_dir, "twice", "checkpoint.pt")
    )  # step 2 half-done: not saved
    logged = [
        json.loads(line)["step"] for line in open(os.path.join(out_dir, "twice", "metrics.jsonl"))
    ]
    assert logged[-1] == 1


@pytest.mark.slow
def test_a_hugging_face_checkpoint_trains_on_a_local_gsm8k_file(tmp_path):
    """--model with --task gsm8k: a tiny random Qwen3-MoE and a character tokenizer saved in Hugging
    Face format, GSM8K-format problems from a local jsonl file; two RL steps of the quads recipe."""
    specials = ["<pad>", "<eos>", "<unk>"]
    characters = list(
        "0123456789+-*=#.,?!:() \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\"'<>/"
    )
    vocab = {token: i for i, token in enumerate(specials + characters)}
    char_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    char_level.pre_tokenizer = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex("."), behavior="isolated"
    )
    char_level.decoder = tokenizers.decoders.Fuse()  # join characters without spaces
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=char_level, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    model_dir = tmp_path / "model"
    hf_tokenizer.save_pretrained(model_dir)
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(model_dir)
    data = tmp_path / "gsm8k.jsonl"
    with open(data, "w") as f:
        for a in range(40):
            f.write(
                json.dumps(
                    {"question": f"What is {a}+2?", "answer": f"{a}+2={a + 2}\n#### {a + 2}"}
                )
                + "\n"
            )

    cfg = train.TrainConfig(
        model=str(model_dir),
        task="gsm8k",
        task_source=str(data),
        recipe="quads",
        steps=2,
        prompts_per_step=2,
        group_size=2,
        warmstart_steps=2,
        warmstart_batch=2,
        eval_prompts=2,
        max_new_tokens=8,
        **in_dir(tmp_path / "runs"),
        device="cpu",
    )
    records = read_metrics(train.run(cfg))
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[
        1:
    ]:  # rewards are counts over the P*G completions, each at most max_new_tokens long
        assert (r["reward"] * 2 * 2).is_integer() and 1 <= r["completion_len"] <= 8
    tokenizer = train.tasks.HFTokenizer(hf_tokenizer)
    assert (
        tokenizer.decode(tokenizer.encode("#### 42") + [tokenizer.eos_id] + tokenizer.encode("x"))
        == "#### 42"
    )


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp8", "rac", "w4a4", "w4a16", "qat-w4a16", "w16a4"])
def test_the_other_recipes_run_end_to_end(out_dir, recipe):
    records = read_metrics(
        train.run(tiny_config(out_dir, recipe=recipe, steps=2, eval_every=2)), rl_steps_only=True
    )
    assert [r["step"] for r in records] == [1, 2]
    if (
        recipe == "qat-w4a16"
    ):  # the trainer's fake-quantized weights are the rollout's: one function
        assert records[0]["mismatch/abs_diff_mean"] < 1e-5
    else:  # every other one rolls out in a precision its trainer does not compute in
        assert records[0]["mismatch/abs_diff_mean"] > 1e-4


@pytest.fixture(scope="module")
def symmetric_runs(out_dir):
    """qat and the two recipes that align the trainer's activations with the rollout's, two steps
    each."""
    return {
        recipe: train.run(tiny_config(out_dir, recipe=recipe, steps=2, eval_every=2))
        for recipe in ("qat", "moeresq", "trace")
    }


def test_moeresq_and_trace_run_end_to_end_with_a_smaller_first_step_gap_than_qat(symmetric_runs):
    first = {
        recipe: read_metrics(run_dir, rl_steps_only=True)
        for recipe, run_dir in symmetric_runs.items()
    }
    for recipe, records in first.items():
        assert [r["step"] for r in records] == [1, 2] and "pass@1" in records[-1], recipe
    gap = {recipe: records[0]["mismatch/abs_diff_mean"] for recipe, records in first.items()}
    print("step-1 mean |dlogp| (measured before the first update):", gap)
    assert gap["qat"] > 1e-4  # an NVFP4 rollout against a trainer with BF16 activations
    assert gap["moeresq"] < gap["qat"] and gap["trace"] < gap["qat"]


def test_moeresq_takes_the_rollouts_own_rac_selection():
    torch.manual_seed(0)
    model = moe.MoETransformer(moe.MoEConfig.from_preset("tiny"))
    model.init_weights(std=0.2)
    rollout_model = rac.convert_for_rollout(copy.deepcopy(model), "nvfp4", rac_ratio=0.5)
    q_rollout, down_rollout = (
        rollout_model.layers[0].attn.q_proj,
        rollout_model.layers[1].mlp.experts,
    )
    for batch in (
        torch.randint(64, (4, 16)),
        7 * torch.randint(9, (4, 16)),
    ):  # a recalibration changes both
        rac.calibrate_rac(rollout_model, batch)
        masks = rac.rac_masks(rollout_model)
        # the rollout's selection, as a snapshot
        assert torch.equal(masks["layers.0.attn.q_proj"][0], q_rollout.rac.mask)
        assert masks["layers.0.attn.q_proj"][0] is not q_rollout.rac.mask
        assert torch.equal(masks["layers.1.mlp.experts"][1], down_rollout.rac_down.mask)
        assert int(q_rollout.rac.mask.sum()) == 2  # half of the 4 blocks


@pytest.mark.slow
def test_route_replay_logs_the_disagreement_it_overrides_and_tis_logs_truncation(out_dir):
    cfg = tiny_config(out_dir, recipe="nvfp4", r3=True, tis=2.0, steps=2, eval_every=2)
    assert cfg.run_name == "nvfp4+tis2+r3"
    records = read_metrics(train.run(cfg), rl_steps_only=True)
    # the trainer ran the rollout's experts; the metric compares its routers' own choice with them
    # (not the replayed routes with themselves, which is 0 by construction)
    assert 0.0 < max(r["routing_disagreement"] for r in records) < 0.5
    assert all(
        r["mismatch/tis_ratio_max"] <= 2.0 and "mismatch/tis_clip_frac" in r for r in records
    )


# ----------------------------------------------------------------------------- the command line
NO_GPU = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message for a machine without a GPU"
)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "-5"], "argument --steps: must be an integer >= 1, got -5"),
        (["--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
        (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
        (["--lr", "0"], "argument --lr: must be a number > 0, got 0.0"),
        (["--lr", "-1"], "argument --lr: must be a number > 0, got -1.0"),
        (["--warmstart-lr", "0"], "argument --warmstart-lr: must be a number > 0"),
        (["--temperature", "nan"], "argument --temperature: must be a number > 0, got nan"),
        (["--eval-every", "0"], "argument --eval-every: must be an integer >= 1, got 0"),
        (["--eval-prompts", "0"], "argument --eval-prompts: must be an integer >= 1"),
        (
            ["--warmstart-steps", "-1"],
            "argument --warmstart-steps: must be an integer >= 0, got -1",
        ),
        (
            ["--prompts-per-step", "-3"],
            "argument --prompts-per-step: must be an integer >= 1, got -3",
        ),
        (["--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1"),
        (["--checkpoint-every", "0"], "argument --checkpoint-every: must be an integer >= 1"),
        (["--threads", "0"], "argument --threads: must be an integer >= 1"),
        (
            ["--group-size", "1"],
            "argument --group-size: must be an integer >= 2 "
            "(GRPO compares the samples of one prompt), got 1",
        ),
        (["--rac-ratio", "1.5"], "argument --rac-ratio: must be in [0, 1], got 1.5"),
        (["--clip-low", "1"], "argument --clip-low: must be in [0, 1), got 1.0"),
        (["--tis", "-1"], "argument --tis: must be a number >= 0 (0 = off), got -1.0"),
        (["--demo-error-rate", "2"], "argument --demo-error-rate: must be in [0, 1]"),
        (["--recipe", "int3"], "argument --recipe: choose from bf16, fp8, nvfp4"),
        (["--preset", "huge"], "argument --preset: choose from tiny, small"),
        (["--task", "chess"], "argument --task: choose from arith, gsm8k"),
        (
            ["--task", "gsm8k"],
            "argument --task: gsm8k needs a real model and its tokenizer: add --model DIR",
        ),
        (
            ["--task", "gsm8k", "--model", "/nonexistent/model"],
            "argument --model: no such directory: /nonexistent/model",
        ),
        (
            ["--model", "Qwen/Qwen3-30B-A3B"],
            "argument --model: a real checkpoint brings its own tokenizer: add --task gsm8k",
        ),
        (["--task-source", "gsm8k.jsonl"], "argument --task-source: applies to --task gsm8k only"),
        (["--device", "tpu"], "argument --device: choose from cpu, cuda, cuda:N, got 'tpu'"),
        (["--device", "cuda:99"], "argument --device: 'cuda:99' but"),
        pytest.param(["--device", "cuda"], "argument --device: 'cuda' but torch", marks=NO_GPU),
        (["--run-name", "a/b"], "argument --run-name: must be a directory name under --out-dir"),
        (["--run-name", "warmstart"], "'warmstart' holds the warm-start cache"),
        (["--resume", "--overwrite"], "argument --overwrite: not allowed with argument --resume"),
        (["--minibatches", "0"], "argument --minibatches: must be an integer >= 1, got 0"),
        (
            ["--minibatches", "129", "--prompts-per-step", "16"],
            "argument --minibatches: must be at most prompts x group size = 128, got 129",
        ),
        (["--mipu", "--tis", "2"], "argument --mipu: not allowed with argument --tis"),
        (["--fsdp"], "argument --fsdp: shards the trainer across torchrun ranks"),
        (["--act-scale", "col"], "argument --act-scale: choose from tensor, row, got 'col'"),
        (
            ["--preset-overrides", "dims=128"],
            "argument --preset-overrides: 'dims' is not a model field",
        ),
        (
            ["--preset-overrides", "dim=1.5"],
            "argument --preset-overrides: dim='1.5' must be an integer",
        ),
        (
            ["--preset-overrides", "dim=72"],
            "dim = 72 must be a multiple of 16 (NVFP4 quantizes 16-element blocks",
        ),
        (
            ["--preset-overrides", "n_heads=3"],
            "argument --preset-overrides: MoEConfig: n_heads=3 is not divisible",
        ),
        (["--preset-overrides", "vocab_size=99"], "'vocab_size' is not a model field"),
        (
            ["--preset-overrides", "max_seq_len=16"],
            "6 prompt + 22 completion tokens exceed the model's max_seq_len=16",
        ),
        (
            ["--difficulty", "30"],
            "62 prompt + 302 completion tokens exceed the model's max_seq_len=256: lower",
        ),
        (
            ["--task", "gsm8k", "--model", "Qwen/Qwen3-30B-A3B", "--preset-overrides", "dim=128"],
            "argument --preset-overrides: not allowed with argument --model",
        ),
        (
            ["--recipe", "w4a16", "--act-scale", "row"],
            "argument --act-scale: 'row' scales NVFP4 activations; recipe w4a16 has none",
        ),
    ],
)
def test_a_bad_value_exits_2_with_one_line_naming_the_flag_and_writes_nothing(
    flags, message, tmp_path, capsys
):
    out_dir = tmp_path / "runs"
    code, out, err = main_exit(flags + ["--out-dir", str(out_dir)], capsys)
    assert code == 2
    assert err.endswith("\n") and err.count("\n") == 1 and err.startswith("train.py: error: ")
    assert message in err
    assert out == "" and not out_dir.exists()


def test_the_real_command_line_exits_2_with_one_line_and_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "train.py", "--steps", "-5", "--out-dir", str(tmp_path / "runs")],
        cwd=os.path.dirname(train.__file__),
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 2
    assert result.stderr == "train.py: error: argument --steps: must be an integer >= 1, got -5\n"
    assert result.stdout == "" and not (tmp_path / "runs").exists()


@pytest.fixture
def gsm8k_dirs(tmp_path):
    """An empty directory (passes as a --model directory until it is loaded) and a valid GSM8K
    file."""
    model_dir, data = tmp_path / "empty_model", tmp_path / "gsm8k.jsonl"
    model_dir.mkdir()
    data.write_text(
        "".join(
            json.dumps({"question": f"{a}+2?", "answer": f"#### {a + 2}"}) + "\n" for a in range(9)
        )
    )
    return str(model_dir), str(data)


def test_data_and_model_that_cannot_be_loaded_give_one_line_with_the_fix(
    gsm8k_dirs, tmp_path, capsys, monkeypatch
):
    model_dir, data = gsm8k_dirs
    out_dir = tmp_path / "runs"
    gsm8k = ["--task", "gsm8k", "--model", model_dir, "--out-dir", str(out_dir)]

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    with monkeypatch.context() as patch:
        patch.setattr(datasets, "load_dataset", offline)
        code, _, err = main_exit(gsm8k, capsys)
    assert code == 2 and err.count("\n") == 1
    assert (
        "argument --task-source: cannot load the gsm8k dataset 'openai/gsm8k' (ConnectionError"
        in err
    )
    assert "offline, give a local file: --task-source FILE.jsonl" in err

    code, _, err = main_exit(gsm8k + ["--task-source", str(tmp_path / "missing.jsonl")], capsys)
    assert code == 2 and err == (
        f"train.py: error: argument --task-source: no such dataset file: {tmp_path}/missing.jsonl\n"
    )

    code, _, err = main_exit(
        gsm8k + ["--task-source", data], capsys
    )  # the data loads; the model does not
    error = err.split("\n")[-2]  # after datasets' progress bar
    assert code == 2 and error.startswith(
        f"train.py: error: argument --model: cannot load {model_dir} (the directory)"
    )
    assert "Traceback" not in err
    assert not out_dir.exists()  # no stray run folder, no warm-start cache


@pytest.mark.slow
def test_refused_commands_modify_no_run_directory(recipe_runs, out_dir, capsys):
    """Checksums of every file under out_dir (runs and warm-start cache) before and after each
    refusal."""
    before = tree_digest(out_dir)
    refusals = [
        (
            cli(out_dir, recipe="bf16"),
            f"{out_dir}/bf16 holds a run (metrics.jsonl, checkpoint.pt): add --resume",
        ),
        (
            cli(out_dir, recipe="bf16", steps=-5),
            "argument --steps: must be an integer >= 1, got -5",
        ),
        (
            cli(out_dir, recipe="bf16", resume=True, lr=0.01),
            "this command changes --lr 0.0001 -> 0.01; a resumed",
        ),
        (
            cli(out_dir, recipe="quads", run_name="nvfp4", resume=True, lr=0.01),
            f"cannot resume {out_dir}/nvfp4: "
            "this command changes --lr 0.0001 -> 0.01, --recipe nvfp4 -> quads; "
            "a resumed run keeps its config",
        ),
        (cli(out_dir, recipe="bf16", resume=True, seed=1), "this command changes --seed 0 -> 1;"),
        (
            cli(out_dir, recipe="bf16", resume=True, difficulty=3),
            "this command changes --difficulty 1 -> 3;",
        ),
        (
            cli(out_dir, recipe="bf16", resume=True, tis=2, run_name="bf16"),
            "changes --tis 0.0 -> 2.0;",
        ),
        (cli(out_dir, recipe="bf16", resume=True, steps=2), "argument --steps: 2, but the run in"),
        (
            cli(out_dir, recipe="bf16", run_name="nothing_here", resume=True),
            f"argument --resume: no checkpoint {out_dir}/nothing_here/checkpoint.pt to resume",
        ),
    ]
    for argv, message in refusals:
        code, _, err = main_exit(argv, capsys)
        assert code == 2 and err.count("\n") == 1 and message in err, (argv, err)
        assert tree_digest(out_dir) == before, argv

    # complete: says so, touches nothing
    code, out, _ = main_exit(cli(out_dir, recipe="bf16", resume=True), capsys)
    assert code == 0
    assert (
        f"run {out_dir}/bf16 is complete at step 3: nothing to do (--steps N > 3 extends it)" in out
    )
    assert tree_digest(out_dir) == before


@pytest.mark.slow
def test_an_unreadable_checkpoint_is_one_line_naming_the_file(recipe_runs, tmp_path, capsys):
    for name, damage in (
        ("truncated", lambda path: open(path, "r+b").truncate(os.path.getsize(path) // 2)),
        ("empty", lambda path: open(path, "w").close()),
        ("foreign", lambda path: torch.save({"weights": torch.ones(2)}, path)),
    ):
        run_dir = tmp_path / name
        shutil.copytree(recipe_runs["bf16"], run_dir)
        damage(run_dir / "checkpoint.pt")
        before = tree_digest(run_dir)
        code, _, err = main_exit(
            cli(tmp_path, recipe="bf16", run_name=name, resume=True, steps=4), capsys
        )
        assert code == 2 and err.count("\n") == 1, err
        assert (
            f"cannot read the checkpoint {run_dir}/checkpoint.pt (" in err
            or f"cannot read the checkpoint {run_dir}/checkpoint.pt: not a train.py checkpoint"
            in err
        )
        assert "start the run over with --overwrite" in err
        assert tree_digest(run_dir) == before


def test_help_documents_every_option_in_its_group_with_its_default():
    parser = train.build_parser()
    text = parser.format_help()
    groups = {
        group.title: [a.dest for a in group._group_actions] for group in parser._action_groups
    }
    assert groups["run"][:4] == ["out_dir", "run_name", "resume", "overwrite"]
    for title, member in (
        ("model and task", "task"),
        ("RL", "steps"),
        ("recipe switches", "recipe"),
    ):
        assert member in groups[title]
    for field in train.dataclasses.fields(train.TrainConfig):
        action = next(a for a in parser._actions if a.dest == field.name)
        assert action.help and len(action.help) > 10, field.name  # every option says what it does
        if field.default not in (None, ""):
            assert f"(default: {field.default})" in action.help, field.name
    assert "--steps N" in text and "RL steps (default 60 on CPU, 200 on GPU)" in " ".join(
        text.split()
    )
    assert "{bf16, fp8, nvfp4" in text  # the choices are listed


def test_cpu_threads_default_to_one_on_the_tiny_preset(monkeypatch):
    calls = []
    monkeypatch.setattr(train.torch, "set_num_threads", calls.append)
    runs.set_threads(train.TrainConfig(device="cpu", preset="tiny"))
    runs.set_threads(train.TrainConfig(device="cpu", preset="tiny", threads=2))
    runs.set_threads(
        train.TrainConfig(device="cpu", preset="small")
    )  # torch's own default: untouched
    assert calls == [1, 2]


@pytest.mark.slow
def test_overwrite_starts_over_and_the_run_ends_with_a_summary(
    recipe_runs, out_dir, capsys, monkeypatch
):
    """--overwrite replaces the run (deterministically: the same records) and whatever was made from
    it (an audit); the bar shows step 0's pass@1 before the first evaluation; the summary gives the
    RL steps' own time, the final pass@1, the mismatch and every path."""
    old = read_metrics(recipe_runs["bf16"])
    os.makedirs(os.path.join(recipe_runs["bf16"], "audit_step3"))  # as tools.audit writes it
    postfixes = []

    class Bar(train.tqdm):
        def set_postfix(self, **kwargs):
            postfixes.append(kwargs)
            super().set_postfix(**kwargs)

    monkeypatch.setattr(train, "tqdm", Bar)
    code, out, _ = main_exit(cli(out_dir, recipe="bf16", overwrite=True), capsys)
    assert code == 0
    new = read_metrics(recipe_runs["bf16"])
    assert [r.get("reward") for r in new] == [r.get("reward") for r in old] and len(new) == 4
    assert postfixes[0]["pass1"] == f"{new[0]['pass@1']:.2f}"  # step 1, before any RL evaluation
    steps = new[1:]
    run_dir = recipe_runs["bf16"]
    assert not os.path.exists(os.path.join(run_dir, "audit_step3"))
    expected = [
        f"bf16: 3 steps; RL steps 1-3 took {sum(r['step_s'] for r in steps):.0f} s\n",
        f"pass@1        rollout {new[-1]['pass@1']:.3f}, "
        f"BF16 trainer {new[-1]['pass@1_bf16_trainer']:.3f} "
        f"at step 3 (step 0: {new[0]['pass@1']:.3f}, {new[0]['pass@1_bf16_trainer']:.3f})",
        f"|delta logp|  mean {sum(r['mismatch/abs_diff_mean'] for r in steps) / 3:.2e}, "
        f"max {max(r['mismatch/abs_diff_max'] for r in steps):.3f} over steps 1-3",
        f"metrics       {run_dir}/metrics.jsonl",
        f"checkpoint    {run_dir}/checkpoint.pt",
        f"figure        python -m tools.plot {run_dir}",
        f"warm-start    {runs.warmstart_path(tiny_config(out_dir))}",
    ]
    for line in expected:
        assert line in out, line
    assert os.path.exists(runs.warmstart_path(tiny_config(out_dir)))


# -------------------------------------------------------------------------- the loop really does RL
P = 3  # prompts per step of the traced runs (G = 4)


@pytest.fixture(scope="module")
def traced_run(out_dir):
    """Two RL steps of a recipe with the loop's data recorded: the Setup object, every training
    rollout, the problems scored, and what reached the loss (advantages, log-probs before the step).
    P != G, so that grouping by the wrong one of the two shows."""

    def trace(recipe):
        record = {"steps": []}
        patch = pytest.MonkeyPatch()
        real_setup, real_generate, real_loss = (
            train.setup,
            train.rollout.generate,
            train.grpo.policy_loss,
        )
        real_score = train.score

        def setup(*args, **kwargs):
            record["setup"] = real_setup(*args, **kwargs)
            record["warm_start"] = copy.deepcopy(record["setup"].trainer.state_dict())
            return record["setup"]

        def generate(model, prompts, num_samples, *args, **kwargs):
            out = real_generate(model, prompts, num_samples, *args, **kwargs)
            if (
                num_samples == TINY["group_size"]
            ):  # a training rollout (evaluation samples 1 per prompt)
                record["steps"].append({"prompts": prompts, "out": out})
            return out

        def score(task, tokenizer, problems, out, group_size):
            if group_size == TINY["group_size"]:
                record["steps"][-1]["problems"] = problems
            return real_score(task, tokenizer, problems, out, group_size)

        def policy_loss(logp, old_logp, advantages, mask, *args, **kwargs):
            record["steps"][-1].update(
                logp=logp.detach().clone(),
                advantages=advantages.detach().clone(),
                mask=mask.clone(),
                weights=copy.deepcopy(record["setup"].trainer.state_dict()),
            )
            return real_loss(logp, old_logp, advantages, mask, *args, **kwargs)

        patch.setattr(train, "setup", setup)
        patch.setattr(train.rollout, "generate", generate)
        patch.setattr(train.grpo, "policy_loss", policy_loss)
        patch.setattr(train, "score", score)
        try:
            train.run(
                tiny_config(
                    out_dir,
                    recipe=recipe,
                    run_name=f"traced_{recipe}",
                    steps=2,
                    eval_every=2,
                    prompts_per_step=P,
                )
            )
        finally:
            patch.undo()
        return record

    return {recipe: trace(recipe) for recipe in ("nvfp4", "quads")}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["nvfp4", "quads"])
def test_after_the_steps_the_rollout_holds_the_requantized_trainer_weights(traced_run, recipe):
    s, warm_start = traced_run[recipe]["setup"], traced_run[recipe]["warm_start"]
    trainer = dict(s.trainer.named_parameters())
    moved = [name for name, w in trainer.items() if not torch.equal(w, warm_start[name])]
    assert len(moved) == len(trainer)  # the optimizer stepped every trainer weight
    n_quantized = 0
    for path, module in s.rollout_model.named_modules():
        if isinstance(module, rac.NVFP4Linear):
            pairs = [(module.weight_q, trainer[f"{path}.weight"])]
        elif isinstance(module, rac.NVFP4Experts):
            pairs = [
                (rac.unchunk_experts(module.gate_up_w), trainer[f"{path}.gate_up_proj"]),
                (rac.unchunk_experts(module.down_w), trainer[f"{path}.down_proj"]),
            ]
        else:
            continue
        for packed, master in pairs:
            expected = nvfp4.quantize_weight(master.detach())
            assert torch.equal(packed.data, expected.data), path
            assert torch.equal(
                packed.block_scale.view(torch.uint8), expected.block_scale.view(torch.uint8)
            ), path
            assert torch.equal(packed.global_scale, expected.global_scale), path
            n_quantized += 1
    assert n_quantized >= 4
    quantized = (rac.NVFP4Linear, rac.NVFP4Experts)
    quantized_paths = {p for p, m in s.rollout_model.named_modules() if isinstance(m, quantized)}
    for (
        name,
        param,
    ) in s.rollout_model.named_parameters():  # embeddings, norms, routers, LM head: copied
        if name.rpartition(".")[0] not in quantized_paths:
            assert torch.equal(param, trainer[name]), name


def expected_advantages(s, step):
    """The oracle: rewards recomputed from the rollout's own tokens, normalized within each prompt's
    G samples (rows p*G .. p*G+G-1) in float64 -> (advantages (N,), number of groups with a reward
    spread)."""
    G = TINY["group_size"]
    out, problems = step["out"], step["problems"]
    assert [s.tokenizer.encode(problems[p].prompt) for p in range(P)] == step["prompts"]
    rewards = torch.tensor(
        [  # row i is sample i % G of prompt i // G
            s.task.reward(problems[i // G], s.tokenizer.decode(ids[mask].tolist()))
            for i, (ids, mask) in enumerate(zip(out.completion_ids, out.completion_mask))
        ],
        dtype=torch.float64,
    )
    grouped = rewards.view(P, G)
    std = grouped.std(dim=1, unbiased=False, keepdim=True)
    advantages = torch.where(
        std > 0, (grouped - grouped.mean(dim=1, keepdim=True)) / (std + 1e-6), 0.0
    )
    return advantages.view(-1), int((std > 0).sum())


@pytest.mark.slow
def test_the_loss_gets_group_advantages_of_the_rewards_of_the_sampled_completions(traced_run):
    s, steps = traced_run["nvfp4"]["setup"], traced_run["nvfp4"]["steps"]
    assert len(steps) == 2
    spread = 0
    for step in steps:
        expected, groups = expected_advantages(s, step)
        torch.testing.assert_close(step["advantages"].double(), expected, rtol=1e-5, atol=1e-6)
        spread += groups
    assert (
        spread >= 2
    )  # some groups had both right and wrong answers: the check had something to check


@pytest.mark.slow
def test_a_step_raises_the_advantage_weighted_logprob_of_the_sampled_tokens(traced_run):
    """The policy-gradient direction end to end: sum_i A_i * sum_t log p(token) over step 1's
    completions, A from the oracle, is higher under the weights after step 1 than under the ones
    that sampled."""
    s, (first, second) = traced_run["nvfp4"]["setup"], traced_run["nvfp4"]["steps"]
    advantages, _ = expected_advantages(s, first)
    seq, model = first["out"].sequences(), copy.deepcopy(s.trainer)

    def objective(weights):
        model.load_state_dict(weights)
        with torch.no_grad():
            logits = model(seq.tokens).double()
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, seq.tokens[:, 1:, None])[..., 0]
        return float((advantages[:, None] * logp * first["mask"]).sum())

    before, after = objective(first["weights"]), objective(second["weights"])
    print(f"advantage-weighted log-prob of step 1's completions: {before:.5f} -> {after:.5f}")
    assert after > before + 1e-4 * abs(before)


# -------------------------------------------------------------------- mini-batches, MIPU, the audit
def update_fixture(**overrides):
    """A random tiny QAT trainer, one batch its NVFP4 rollout sampled (4 prompts x 4 samples),
    advantages of both signs, and the run's AdamW."""
    cfg = tiny_config("unused", recipe="quads", lr=1e-2, **overrides)
    task = train.build_task(cfg)
    model, tokenizer = train.build_model(cfg, task)
    rollout_model = rac.convert_for_rollout(copy.deepcopy(model), "nvfp4")
    trainer = qat.convert_for_training(model)
    prompts = train.encode_prompts(tokenizer, task.sample(4, "train", random.Random(0)))
    seq = rollout.generate(
        rollout_model, prompts, 4, 12, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, seed=0
    ).sequences()
    advantages = torch.randn(16, generator=torch.Generator().manual_seed(0))
    return cfg, trainer, seq, advantages


def adamw(cfg, model):
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99))


def test_one_minibatch_is_the_plain_on_policy_update_bit_for_bit():
    cfg, trainer, seq, advantages = update_fixture(tis=2.0)
    reference = copy.deepcopy(trainer)
    old, _, stats = train.policy_update(
        cfg, trainer, adamw(cfg, trainer), seq, advantages, shuffle_seed=0
    )
    # the update before mini-batches existed: one forward, old = its own detached log-probs, one
    # step (the log-probs as the trainer computes them: bit for bit needs the same formula)
    optimizer = adamw(cfg, reference)
    targets = torch.nn.functional.pad(seq.tokens[:, 1:], (0, 1))  # the last column has none
    logp = reference(seq.tokens, targets=targets)[:, :-1]
    loss, _ = grpo.policy_loss(
        logp,
        logp.detach(),
        advantages,
        seq.loss_mask[:, 1:],
        cfg.clip_low,
        cfg.clip_high,
        rollout_logprobs=seq.logprobs[:, 1:],
        tis_cap=2.0,
    )
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.grad_clip)
    optimizer.step()
    assert torch.equal(old, logp.detach()) and len(stats) == 1 and stats[0]["loss"] == loss.item()
    for (name, updated), expected in zip(trainer.named_parameters(), reference.parameters()):
        assert torch.equal(updated, expected), name
    assert (
        stats[0]["ratio/min"] == stats[0]["ratio/max"] == 1.0
        and stats[0]["clip_ratio/region_mean"] == 0.0
    )


def test_several_minibatches_move_the_ratio_after_the_first_and_the_clip_responds_to_clip_high():
    clipped_high = {}
    for clip_high in (1e-3, 10.0):
        cfg, trainer, seq, advantages = update_fixture(minibatches=4, clip_high=clip_high)
        with torch.no_grad():
            sampling_weights_logp = train.trainer_logprobs(cfg, trainer, seq)[0]
        old, _, stats = train.policy_update(cfg, trainer, adamw(cfg, trainer), seq, advantages, 0)
        assert torch.equal(old, sampling_weights_logp)  # old: before the first step, not after
        assert len(stats) == 4
        print(clip_high, [(round(s["ratio/min"], 4), round(s["ratio/max"], 4)) for s in stats])
        assert (
            1 - 1e-5 < stats[0]["ratio/min"] <= stats[0]["ratio/max"] < 1 + 1e-5
        )  # the sampling weights
        assert all(s["ratio/max"] - s["ratio/min"] > 1e-3 for s in stats[1:])
        clipped_high[clip_high] = [s["clip_ratio/high_mean"] for s in stats]
    assert clipped_high[1e-3][0] == 0.0 and sum(clipped_high[1e-3][1:]) > 0.0
    assert sum(clipped_high[10.0]) == 0.0


class RecordingClock:
    """A StepClock stand-in that keeps the order of the phases charged."""

    def __init__(self):
        self.laps = []

    def lap(self, phase):
        self.laps.append(phase)


def test_the_update_charges_each_forward_to_logprobs_and_each_backward_and_step_to_update():
    cfg, trainer, seq, advantages = update_fixture(micro_batch=8)  # 16 rows: two pieces
    clock = RecordingClock()
    train.policy_update(cfg, trainer, adamw(cfg, trainer), seq, advantages, 0, clock=clock)
    # the reference forward (none here), then per piece its forward and its backward, then the step
    assert clock.laps == ["logprobs", "logprobs", "update", "logprobs", "update", "update"]
    cfg, trainer, seq, advantages = update_fixture(minibatches=2)
    clock = RecordingClock()
    train.policy_update(cfg, trainer, adamw(cfg, trainer), seq, advantages, 0, clock=clock)
    # the forward without gradient over every row first (old), then two mini-batches
    expected = ["logprobs", "logprobs"] + ["logprobs", "update", "update"] * 2
    assert clock.laps == expected


def test_a_step_logs_the_time_of_each_phase_adding_up_to_the_step(recipe_runs):
    for recipe, run_dir in recipe_runs.items():
        records = read_metrics(run_dir)[1:]
        phases = ("rollout", "reward", "logprobs", "update", "metrics", "sync")
        for record in records:
            seconds = [record[f"{phase}_s"] for phase in phases]
            assert all(s >= 0 for s in seconds), (recipe, record)
            total = sum(seconds) + record.get("eval_s", 0.0)
            # the phases cover the step but for the prompts' sampling and the record's assembly
            assert 0.9 * record["step_s"] <= total <= record["step_s"], (recipe, record)
        assert "eval_s" in records[-1] and "eval_s" not in records[0]


def test_update_metrics_average_over_minibatches_and_keep_the_extremes():
    stats = [
        {
            "loss": 1.0,
            "grad_norm": 2.0,
            "ratio/mean": 1.0,
            "ratio/min": 1.0,
            "ratio/max": 1.0,
            "clip_ratio/low_mean": 0.0,
            "clip_ratio/high_mean": 0.0,
            "clip_ratio/region_mean": 0.0,
            "approx_kl": 0.0,
            "entropy": 0.5,
        },
        {
            "loss": 3.0,
            "grad_norm": 4.0,
            "ratio/mean": 1.2,
            "ratio/min": 0.5,
            "ratio/max": 3.0,
            "clip_ratio/low_mean": 0.1,
            "clip_ratio/high_mean": 0.3,
            "clip_ratio/region_mean": 0.4,
            "approx_kl": 0.2,
            "entropy": 0.7,
        },
    ]
    record = train.update_metrics(tiny_config("unused", minibatches=2), stats)
    assert record == pytest.approx(
        {
            "loss": 2.0,
            "grad_norm": 3.0,
            "ratio/mean": 1.1,
            "ratio/min": 0.5,
            "ratio/max": 3.0,
            "clip_ratio/low_mean": 0.05,
            "clip_ratio/high_mean": 0.15,
            "clip_ratio/region_mean": 0.2,
            "approx_kl": 0.1,
            "entropy/trainer": 0.6,
        }
    )
    # on policy (one mini-batch, ratio 1) the clipped fractions are logged, the ratio's are not
    assert train.update_metrics(tiny_config("unused"), stats[:1]) == {
        "loss": 1.0,
        "grad_norm": 2.0,
        "entropy/trainer": 0.5,
        "clip_ratio/low_mean": 0.0,
        "clip_ratio/high_mean": 0.0,
        "clip_ratio/region_mean": 0.0,
    }


def test_on_policy_runs_log_no_ratio_statistics(recipe_runs):
    record = read_metrics(recipe_runs["quads"], rl_steps_only=True)[0]
    assert not any(key.startswith(("ratio/", "approx_kl", "mipu/")) for key in record)
    # the clipped fractions are logged always: 0 on policy, where the ratio is 1
    assert record["clip_ratio/region_mean"] == record["clip_ratio/dual_mean"] == 0.0


@pytest.mark.parametrize("proxy", [-1.0, 1.0])
def test_mipu_keeps_an_accepted_candidate_and_restores_a_rejected_one(out_dir, monkeypatch, proxy):
    monkeypatch.setattr(train.grpo, "mipu_proxy", lambda *args: proxy)
    # the short warm-start rarely solves a problem: advantages of both signs, so that every update
    # moves
    generator = torch.Generator().manual_seed(0)
    monkeypatch.setattr(
        train.grpo,
        "group_advantages",
        lambda rewards, G: torch.randn(len(rewards), generator=generator),
    )
    # what the rollout model computes on a fixed probe, each time it samples (steps and evaluations)
    outputs, real_generate, probe = {}, train.rollout.generate, torch.tensor([[1, 2, 3, 4, 5, 6]])

    def recording_generate(model, *args, **kwargs):
        with torch.no_grad():
            outputs.setdefault(id(model), []).append(model(probe))
        return real_generate(model, *args, **kwargs)

    monkeypatch.setattr(train.rollout, "generate", recording_generate)
    cfg = tiny_config(
        out_dir, recipe="quads", mipu=True, steps=2, eval_every=2, run_name=f"mipu{proxy:+g}"
    )
    records = read_metrics(train.run(cfg))
    rollout_outputs = next(
        iter(outputs.values())
    )  # the rollout model samples first (the step-0 evaluation)
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


def test_minibatches_and_mipu_name_the_run():
    cfg = train.TrainConfig(device="cpu", recipe="nvfp4", minibatches=4, mipu=True)
    assert cfg.run_name == "nvfp4+mb4+mipu"
    assert train.TrainConfig(device="cpu", recipe="quads", act_scale="row").run_name == "quads+row"


@pytest.mark.slow
def test_row_scales_let_a_symmetric_trainer_round_each_token_as_its_rollout_did(out_dir):
    # the trainer quantizes the whole batch at once, the rollout one decode step of it at a time:
    # with one global scale per tensor their roundings differ, with one per row they are the same
    # function of the row
    gap = {
        act_scale: read_metrics(
            train.run(
                tiny_config(
                    out_dir,
                    recipe="w4a4",
                    steps=1,
                    eval_every=1,
                    act_scale=act_scale,
                    run_name=f"w4a4-{act_scale}",
                )
            ),
            rl_steps_only=True,
        )[0]["mismatch/abs_diff_mean"]
        for act_scale in ("tensor", "row")
    }
    print("step-1 mean |dlogp| of w4a4:", gap)
    assert gap["tensor"] > 1e-3 and gap["row"] < 1e-5


# ----------------------------------------------------------------- torchrun (gloo, 2 CPU processes)
TORCHRUN_ARGS = [
    "--recipe",
    "bf16",
    "--difficulty",
    "1",
    "--warmstart-steps",
    "100",
    "--prompts-per-step",
    "5",
    "--group-size",
    "4",
    "--eval-prompts",
    "9",
    "--eval-every",
    "3",
    "--checkpoint-every",
    "1",
    "--lr",
    "1e-3",
    "--device",
    "cpu",
]
COMPARED = (
    "reward",
    "loss",
    "grad_norm",
    "completion_len",
    "pass@1",
    "pass@1_bf16_trainer",
    "mismatch/trainer_ppl",
    "mismatch/rollout_ppl",
)


def _train_py(out_dir, *extra, nproc=0):
    """train.py in a fresh process, under torchrun with nproc ranks (nproc=0: plain python)."""
    import subprocess
    import sys

    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc
        else [sys.executable]
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        launcher
        + [os.path.join(repo, "train.py"), *TORCHRUN_ARGS, "--out-dir", str(out_dir)]
        + ["--warmstart-dir", os.path.join(str(out_dir), "warmstart"), *extra],
        capture_output=True,
        text=True,
        env=env,
        cwd=repo,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [
        d
        for d in os.listdir(out_dir)
        if d != "warmstart" and os.path.isdir(os.path.join(out_dir, d))
    ]
    assert len(runs) == 1, runs
    return os.path.join(str(out_dir), runs[0])


def _same_run(a, b, steps, rel=1e-5, weight_atol=1e-5):
    """Metrics of the steps in `steps` and the final weights agree to fp32 reduction-order
    tolerance."""
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
        torch.testing.assert_close(
            wb["trainer"][name], weight, atol=weight_atol, rtol=1e-4, msg=name
        )


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory):
    """The reference: one process, 3 steps of 5 prompts x 4 samples; its warm-start cache is
    reused."""
    out = tmp_path_factory.mktemp("single")
    run_dir = _train_py(out, "--steps", "3")
    assert any(
        r.get("grad_norm", 0) > 0 for r in read_metrics(run_dir)
    )  # the steps do learn something
    return out, run_dir


def _with_warmstart(single_out, tmp_path):
    import shutil

    shutil.copytree(os.path.join(single_out, "warmstart"), tmp_path / "warmstart")
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_give_the_single_process_run(single_process_run, tmp_path, mode):
    """Same global batch (5 groups: shards of 3 and 2, so the token-mean loss must be weighted
    right): same rewards, losses, gradient norms, pass@1 and final weights as one process."""
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


@pytest.mark.slow
def test_two_ranks_take_the_single_process_mipu_decisions(single_process_run, tmp_path):
    """MIPU accepts or rejects on the whole batch's proxy: with each rank deciding on its own rows
    the ranks' weights would part ways (and differ from one process's)."""
    single_out, _ = single_process_run
    one = _train_py(_with_warmstart(single_out, tmp_path / "one"), "--steps", "3", "--mipu")
    two = _train_py(
        _with_warmstart(single_out, tmp_path / "two"), "--steps", "3", "--mipu", nproc=2
    )
    records = {r["step"]: r for r in read_metrics(one)}
    decisions = [records[step]["mipu/accepted"] for step in (1, 2, 3)]
    assert any(
        records[step]["mipu/proxy"] != 0 for step in (1, 2, 3)
    )  # the proxy has something to decide
    for step, accepted in zip((1, 2, 3), decisions):
        assert {r["step"]: r for r in read_metrics(two)}[step]["mipu/accepted"] == accepted, step
        assert {r["step"]: r for r in read_metrics(two)}[step]["mipu/proxy"] == pytest.approx(
            records[step]["mipu/proxy"], rel=1e-4, abs=1e-9
        )
    # Adam turns reduction-order noise in near-zero gradients into update noise: 5e-5 here after two
    # accepted steps at lr 1e-3, against a whole step (~1e-3) where the ranks' decisions part ways
    _same_run(one, two, steps=(0, 1, 2, 3), rel=1e-4, weight_atol=3e-4)


# ================================================================= the starting policy (warm-start)
def warmstart_config(out_dir, **overrides):
    return train.TrainConfig(
        **{
            **dict(
                preset="tiny",
                difficulty=1,
                warmstart_steps=40,
                warmstart_batch=16,
                device="cpu",
                **in_dir(out_dir),
            ),
            **overrides,
        }
    )


def demonstration_loss(cfg, model, task, tokenizer):
    """Mean negative log-prob of 64 fixed demonstrations' completion + EOS tokens (the oracle: a
    loop)."""
    import random

    rng, total, count = random.Random(123), 0.0, 0
    for p in task.sample(64, "train", rng):
        prompt = tokenizer.encode(p.prompt)
        row = torch.tensor(
            [prompt + tokenizer.encode(task.demonstration(p, rng)) + [tokenizer.eos_id]]
        )
        with torch.no_grad():
            logp = log_softmax_gather(model(row[:, :-1]).float(), row[:, 1:])[0, len(prompt) - 1 :]
        total, count = total - logp.sum().item(), count + logp.numel()
    return total / count


def test_the_warm_start_is_keyed_by_what_determines_it_and_not_by_the_recipe(tmp_path):
    base = runs.warmstart_path(warmstart_config(tmp_path))
    assert runs.warmstart_path(warmstart_config(tmp_path, recipe="nvfp4", tis=2.0)) == base
    assert runs.warmstart_path(warmstart_config(tmp_path, seed=1)) != base
    assert runs.warmstart_path(warmstart_config(tmp_path, warmstart_lr=1e-3)) != base


def test_preset_overrides_key_their_own_warm_start_and_leave_the_others_keys_as_they_were(tmp_path):
    cfg = warmstart_config(tmp_path)
    fields = (
        "preset",
        "model",
        "task",
        "task_source",
        "difficulty",
        "demo_error_rate",
        "warmstart_steps",
        "warmstart_batch",
        "warmstart_lr",
        "seed",
        "device",
    )  # the key before the option existed
    key = json.dumps({name: getattr(cfg, name) for name in fields}, sort_keys=True)
    assert runs.warmstart_path(cfg) == os.path.join(
        str(tmp_path), "warmstart", hashlib.sha1(key.encode()).hexdigest()[:12] + ".pt"
    )
    wide = runs.warmstart_path(warmstart_config(tmp_path, preset_overrides="dim=128"))
    assert wide != runs.warmstart_path(cfg)
    assert wide != runs.warmstart_path(warmstart_config(tmp_path, preset_overrides="dim=256"))


def test_preset_overrides_build_the_model_they_name():
    cfg = train.TrainConfig(
        preset="tiny",
        device="cpu",
        preset_overrides="dim=128,head_dim=32,expert_dim=96,"
        "n_layers=3,norm_topk_prob=false,rope_theta=500.0",
    )
    model, tokenizer = train.build_model(cfg, train.build_task(cfg))
    c = model.config
    assert (c.dim, c.head_dim, c.expert_dim, c.n_layers, c.norm_topk_prob, c.rope_theta) == (
        128,
        32,
        96,
        3,
        False,
        500.0,
    )
    assert (c.n_heads, c.n_experts, c.vocab_size) == (
        4,
        8,
        tokenizer.vocab_size,
    )  # the rest: the preset's
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes["embed.weight"] == (tokenizer.vocab_size, 128)
    assert sum(name.endswith("q_proj.weight") for name in shapes) == 3
    assert all(
        shape == (4 * 32, 128) for name, shape in shapes.items() if name.endswith("q_proj.weight")
    )


def test_the_warm_start_lowers_the_demonstration_loss_and_loads_back_bit_for_bit(tmp_path, capsys):
    cfg = warmstart_config(tmp_path)
    task = train.build_task(cfg)
    model, tokenizer = train.build_model(cfg, task)
    before = demonstration_loss(cfg, model, task, tokenizer)
    train.warmstart(cfg, model, task, tokenizer)
    after = demonstration_loss(cfg, model, task, tokenizer)
    assert after < 0.8 * before, (before, after)
    again, _ = train.build_model(cfg, task)
    train.warmstart(cfg, again, task, tokenizer)
    assert f"warm-start: loaded {runs.warmstart_path(cfg)}" in capsys.readouterr().out
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values())
    )


def test_a_model_that_cannot_be_loaded_is_one_line_naming_the_flag(tmp_path):
    cfg = train.TrainConfig(model=str(tmp_path), task="gsm8k", device="cpu")
    with pytest.raises(train.ConfigError, match="argument --model: cannot load") as error:
        train.build_model(cfg, None)
    assert str(error.value).startswith(f"argument --model: cannot load {tmp_path} (the directory)")


# ====================================================================== trace: the rollout's record
def test_the_rollout_records_only_when_handed_a_recorder_and_the_trainer_takes_the_codes():
    torch.manual_seed(0)
    model = moe.MoETransformer(moe.MoEConfig.from_preset("tiny"))
    model.init_weights(std=0.2)
    trace_trainer = symmetric.convert_for_training(copy.deepcopy(model), "trace")
    rollout_model = rac.convert_for_rollout(copy.deepcopy(model), "nvfp4")
    recorder = rac.InputRecorder(rollout_model)
    generate = dict(num_samples=2, max_new_tokens=4, eos_id=None, pad_id=0, seed=0)
    rollout.generate(rollout_model, [[1, 2, 3]], **generate)  # an evaluation: not recorded
    assert recorder.steps == {}
    out = rollout.generate(
        rollout_model, [[1, 2, 3]], **generate, decode_hand_offs=recorder.hand_offs()
    )
    share = symmetric.RolloutShare(codes=recorder.codes(out))
    # 2 samples x 4 decode steps; the experts' down input: A = 2 records a token
    assert share.codes["layers.0.attn.o_proj"][0].keys.numel() == 2 * 4
    assert share.codes["layers.1.mlp.experts"][1].keys.numel() == 2 * 4 * 2
    # q, k and v read one input: one record, under each of their paths
    qkv = [share.codes[f"layers.0.attn.{name}_proj"][0] for name in "qkv"]
    assert qkv[0] is qkv[1] is qkv[2]
    hand_offs = share.hand_offs(trace_trainer)
    assert hand_offs["layers.0.attn.o_proj"].codes is share.codes["layers.0.attn.o_proj"]
    # nothing stays on the layers: a forward without the hand-offs rounds on its own
    seq = out.sequences()
    guided = trace_trainer(seq.tokens, hand_offs=hand_offs)
    own = trace_trainer(seq.tokens)
    assert not torch.equal(guided, own)
    assert torch.equal(own, trace_trainer(seq.tokens))


def test_trace_with_row_scales_keeps_its_first_steps_gap_over_later_rollouts(tmp_path):
    """With one activation scale per row, TRACE's trainer rounds every completion token as its
    rollout did, so the gap stays at fp32 order on every step, not only the first (each rollout
    records with the run's act_scale)."""
    cfg = tiny_config(
        tmp_path, recipe="trace", act_scale="row", steps=4, warmstart_steps=20, eval_every=100
    )
    train.run(cfg)
    records = read_metrics(os.path.join(tmp_path, cfg.run_name), rl_steps_only=True)
    gaps = [r["mismatch/abs_diff_mean"] for r in records]
    print("mean |dlogp| per step", gaps)
    assert len(gaps) == 4
    assert max(gaps) < 1e-5


def test_moeresq_with_mipu_scores_the_trainer_with_the_masks_that_sampled_the_batch(
    tmp_path, monkeypatch
):
    """The trainer forwards of a step (the update, then MIPU's trainer proxy after the sync) take
    the RAC masks of the rollout that sampled the batch, though the sync recalibrates the rollout's
    own."""
    seen = []
    original = train.trainer_logprobs

    def spy(cfg, trainer, seq, share=None, *args, **kwargs):
        seen.append({path: [m.clone() for m in masks] for path, masks in share.masks.items()})
        return original(cfg, trainer, seq, share, *args, **kwargs)

    monkeypatch.setattr(train, "trainer_logprobs", spy)
    cfg = tiny_config(
        tmp_path,
        recipe="moeresq",
        mipu=True,
        lr=0.05,
        steps=2,
        warmstart_steps=20,
        eval_every=100,
    )
    s = train.setup(cfg)
    changed = False
    for step in range(cfg.steps):
        before = rac.rac_masks(s.rollout_model)
        seen.clear()
        train.rl_step(s, step, runs.HeldInterrupt(step), [])
        after = rac.rac_masks(s.rollout_model)
        changed = changed or any(
            not torch.equal(a, b) for path in before for a, b in zip(before[path], after[path])
        )
        assert len(seen) >= 2  # the update's forward and the proxy's
        for masks in seen:
            for path, layer_masks in masks.items():
                for mask, sampled in zip(layer_masks, before[path]):
                    assert torch.equal(mask, sampled), path
    assert changed  # the recalibration did move the rollout's selection: the test can tell


# -------------------------------------------------- real checkpoints: memory-saving paths, exact
def symmetric_fixture(mode, **overrides):
    """update_fixture's batch for a trainer in `mode` (qat or a symmetric mode), with what its
    rollout hands it (moeresq's masks, trace's recorded codes)."""
    cfg = tiny_config("unused", recipe=mode if mode != "qat" else "quads", lr=1e-2, **overrides)
    task = train.build_task(cfg)
    model, tokenizer = train.build_model(cfg, task)
    rollout_model = rac.convert_for_rollout(copy.deepcopy(model), "nvfp4", rac_ratio=0.5)
    rac.calibrate_rac(rollout_model, train.calibration_tokens(cfg, task, tokenizer))
    if mode == "qat":
        trainer = qat.convert_for_training(model)
    else:
        trainer = symmetric.convert_for_training(model, mode)
    recorder = train.rollout_recorder(cfg, rollout_model)
    hand_offs = recorder.hand_offs() if recorder is not None else None
    prompts = train.encode_prompts(tokenizer, task.sample(4, "train", random.Random(0)))
    out = rollout.generate(
        rollout_model,
        prompts,
        4,
        12,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        seed=0,
        decode_hand_offs=hand_offs,
    )
    share = train.share_of_rollout(cfg, rollout_model, out, recorder)
    return cfg, trainer, out.sequences(), share


@pytest.mark.parametrize("mode", ["bf16", "qat", "w4a4", "moeresq", "trace"])
def test_grad_checkpointing_gives_the_plain_runs_gradients_bit_for_bit(mode):
    if mode == "bf16":
        cfg, trainer, seq, _ = update_fixture()
        trainer = tiny_model_of(cfg)
        share = None
    else:
        cfg, trainer, seq, share = symmetric_fixture(mode)
    grads = []
    for checkpointed in (False, True):
        run_cfg = dataclasses.replace(cfg, grad_checkpoint=checkpointed)
        trainer.zero_grad(set_to_none=True)
        logp = train.trainer_logprobs(run_cfg, trainer, seq, share)[0]
        (logp * seq.loss_mask[:, 1:]).sum().backward()
        grads.append([p.grad.clone() for p in trainer.parameters()])
    for (name, _), plain, checkpointed in zip(trainer.named_parameters(), *grads):
        assert torch.equal(plain, checkpointed), name
    assert any(g.abs().sum() > 0 for g in grads[0])


def tiny_model_of(cfg):
    task = train.build_task(cfg)
    return train.build_model(cfg, task)[0]


def test_grad_checkpointing_keeps_only_the_blocks_inputs(monkeypatch):
    """With checkpointing each block runs twice (forward, then again in the backward)."""
    cfg, _, seq, _ = update_fixture()
    model = tiny_model_of(cfg)
    calls = []
    original = moe.Block.forward

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(moe.Block, "forward", counting)
    for checkpointed, expected in ((False, 2), (True, 4)):
        calls.clear()
        run_cfg = dataclasses.replace(cfg, grad_checkpoint=checkpointed)
        logp = train.trainer_logprobs(run_cfg, model, seq)[0]
        logp.sum().backward()
        assert len(calls) == expected


def test_chunked_logprobs_equal_the_whole_logits_values_and_gradients(monkeypatch):
    """token_logprobs a few positions at a time equals log_softmax_gather of the whole logits
    (the oracle: one log-softmax over every position), values and gradients, to fp32 order."""
    torch.manual_seed(0)
    model = moe.MoETransformer(moe.MoEConfig.from_preset("tiny", vocab_size=96))
    tokens = torch.randint(96, (3, 11))
    targets = torch.randint(96, (3, 11))
    whole = log_softmax_gather(model(tokens).float() / 0.7, targets)
    whole.sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    monkeypatch.setattr(moe, "LOGPROB_CHUNK_ELEMENTS", 96 * 5)  # 5 positions a chunk: 7 chunks
    assert moe.logprob_chunk_tokens(96) == 5
    chunked = model(tokens, targets=targets, temperature=0.7)
    assert report_diff(chunked, whole, "chunked vs whole")[0] < 1e-5
    chunked.sum().backward()
    for (name, param), expected in zip(model.named_parameters(), expected_grads):
        scale = expected.abs().max().item() + 1e-12
        assert report_diff(param.grad, expected, name)[0] <= 1e-5 * scale, name
    # the chunk size follows the vocabulary: Qwen3's 151,936 entries give 441 positions
    monkeypatch.undo()
    assert moe.logprob_chunk_tokens(151_936) == 2**26 // 151_936 == 441


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(tis=2.0),
        dict(minibatches=2),
        dict(r3=True, tis=2.0),
        dict(mipu=True),
    ],
    ids=["plain", "tis", "minibatches", "r3", "mipu"],
)
def test_micro_batches_accumulate_the_whole_batch_update(overrides):
    """--micro-batch 3 (pieces of 3, 3, 3, ..., 1 rows) takes the optimizer step of the whole
    (mini-)batch: the DAPO denominator is the whole batch's tokens, to fp32 summation order."""
    cfg, trainer, seq, advantages = update_fixture(**overrides)
    results = []
    for micro_batch in (0, 3):
        model = copy.deepcopy(trainer)
        run_cfg = dataclasses.replace(cfg, micro_batch=micro_batch)
        # SGD: the step is the accumulated gradient itself (AdamW's normalization would magnify
        # the fp32-order differences of near-zero gradients)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        old, routes, stats = train.policy_update(
            run_cfg, model, optimizer, seq, advantages, shuffle_seed=0
        )
        results.append((model, old, routes, stats))
    (whole, old_w, routes_w, stats_w), (micro, old_m, routes_m, stats_m) = results
    assert torch.equal(routes_w, routes_m)
    assert report_diff(old_m, old_w, "old log-probs")[0] < 1e-6
    assert len(stats_w) == len(stats_m) == cfg.minibatches
    for s_w, s_m in zip(stats_w, stats_m):
        assert s_w.keys() == s_m.keys()
        for key in s_w:
            assert abs(s_w[key] - s_m[key]) <= 1e-5 * max(1.0, abs(s_w[key])), key
    for (name, p_w), p_m in zip(whole.named_parameters(), micro.parameters()):
        assert report_diff(p_m, p_w, name)[0] < 1e-6, name  # lr 1: the gradients themselves
    moved = any(not torch.equal(p, q) for p, q in zip(whole.parameters(), trainer.parameters()))
    assert moved


# ----------------------------------------------------------------------------- pass@k, samples, and
# the flags that change nothing refused
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_right_completion():
    # the oracle: every k-subset of n completions, c of them right, counted
    for samples in range(1, 7):
        for correct in range(samples + 1):
            outcomes = [True] * correct + [False] * (samples - correct)
            for k in range(1, samples + 1):
                subsets = list(itertools.combinations(outcomes, k))
                share = sum(any(subset) for subset in subsets) / len(subsets)
                assert train.pass_at_k(correct, samples, k) == pytest.approx(share, abs=1e-12)


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory):
    """Two steps evaluated after each, four completions per held-out prompt."""
    out_dir = tmp_path_factory.mktemp("sampled")
    cfg = tiny_config(out_dir, recipe="bf16", steps=2, eval_every=1, eval_samples=4)
    return cfg, train.run(cfg)


def test_every_evaluation_logs_pass_at_k_up_to_its_samples_for_both_models(sampled_run):
    cfg, run_dir = sampled_run
    evals = read_metrics(run_dir)
    assert [r["step"] for r in evals] == [0, 1, 2] and all("pass@1" in r for r in evals)
    for record in evals:
        for suffix in ("", "_bf16_trainer"):
            values = [record[f"pass@{k}{suffix}"] for k in (1, 2, 4)]
            assert "pass@3" + suffix not in record  # k = 1, 2, 4, ... and the samples
            assert values == sorted(values)  # more tries never pass less often
            # pass@4 of 4 samples is the share of prompts with a right one: a count over prompts
            prompts_passed = values[-1] * cfg.eval_prompts
            assert prompts_passed == pytest.approx(round(prompts_passed))


def test_every_evaluation_writes_sample_completions_with_their_rewards(sampled_run):
    cfg, run_dir = sampled_run
    samples = runs.read_metrics(os.path.join(run_dir, "samples.jsonl"))
    assert [r["step"] for r in samples] == [0] * 4 + [1] * 4 + [2] * 4
    task = train.build_task(cfg)
    held_out = task.sample(cfg.eval_prompts, "test", random.Random(cfg.seed + 999))
    for sample in samples:
        assert sample["model"] == "rollout"
        assert sample["prompt"] in [p.prompt for p in held_out[: train.SHOWN_SAMPLES]]
        problem = next(p for p in held_out if p.prompt == sample["prompt"])
        assert sample["answer"] == problem.answer
        assert sample["reward"] == task.reward(problem, sample["completion"])  # the verifier's


def test_each_step_logs_the_rollouts_entropy_and_the_clipped_fractions(sampled_run):
    _, run_dir = sampled_run
    for record in read_metrics(run_dir, rl_steps_only=True):
        # mean -log p of the sampled tokens = log of the rollout's perplexity (computed apart)
        entropy = math.log(record["mismatch/rollout_ppl"])
        assert record["entropy/rollout"] == pytest.approx(entropy, rel=1e-5)
        assert record["clip_ratio/region_mean"] == 0.0  # one mini-batch: the ratio is 1


def test_the_summary_shows_the_last_evaluations_first_sample(tmp_path, capsys):
    cfg = tiny_config(tmp_path, recipe="bf16", steps=1, eval_samples=2)
    run_dir = train.run(cfg)
    out = capsys.readouterr().out
    last = runs.read_metrics(os.path.join(run_dir, "samples.jsonl"))[-4]  # step 1's first
    assert last["step"] == 1
    shown = f"  sample        step 1, reward {last['reward']:g}: {last['prompt']!r} -> "
    assert shown + repr(last["completion"]) in out.splitlines()
    assert "  pass@k        rollout pass@2 " in out


def test_the_default_run_name_carries_the_preset_overrides():
    cfg = train.TrainConfig(device="cpu", preset_overrides="dim=128,head_dim=32,expert_dim=128")
    assert cfg.run_name == "quads+dim=128,head_dim=32,expert_dim=128"
    assert train.TrainConfig(device="cpu").run_name == "quads"  # the README's first run


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--recipe", "w4a16", "--rac-ratio", "0.3"],
            "argument --rac-ratio: recipe w4a16 has no RAC, so the value would change nothing; "
            "RAC recipes: rac, quads, moeresq",
        ),
        (["--recipe", "bf16", "--rac-refresh", "4"], "argument --rac-refresh: recipe bf16 has no"),
        # difficulty 2: 2 steps of 8, ';', '>' and up to 3 digits = 21 = 10 * 2 + 1 characters
        (
            ["--max-new-tokens", "1"],
            "argument --max-new-tokens: must be at least 21, the longest completion of the arith "
            "task at --difficulty 2",
        ),
        (["--max-new-tokens", "20"], "argument --max-new-tokens: must be at least 21"),
        (["--difficulty", "3", "--max-new-tokens", "30"], "must be at least 31"),
        (["--clip-ratio-c", "1"], "argument --clip-ratio-c: must be 0 (off) or a number > 1"),
        (["--kl-coef", "-1"], "argument --kl-coef: must be a number >= 0 (0 = off), got -1.0"),
        (["--eval-samples", "0"], "argument --eval-samples: must be an integer >= 1, got 0"),
        (["--log-to", "csv"], "argument --log-to: choose from tensorboard, wandb, got 'csv'"),
        (["--warmstart-dir", ""], "argument --warmstart-dir: must name a directory"),
        (["--out-dir", "/dev/null/runs"], "argument --out-dir: cannot make /dev/null/runs"),
    ],
)
def test_a_flag_that_would_change_nothing_is_refused_in_one_line(flags, message, tmp_path, capsys):
    code, out, err = main_exit(flags + ["--device", "cpu", "--warmstart-steps", "0"], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("train.py: error: ")
    assert message in err and out == ""
    assert train.TrainConfig(device="cpu", max_new_tokens=21).max_new_tokens == 21  # enough


def test_the_ctrl_c_lines_are_lines_of_their_own_below_the_progress_bar(
    tmp_path, monkeypatch, capsys
):
    _ctrl_c_during_the_second_update(monkeypatch, presses=1)
    with pytest.raises(SystemExit):
        train.run(tiny_config(tmp_path, recipe="bf16", run_name="own_line", steps=3))
    lines = capsys.readouterr().err.split("\n")
    assert any(
        line.startswith("Ctrl-C: finishing this step's update, then saving") for line in lines
    )
    stopped = f"stopped: checkpoint at step 2 in {tmp_path}/own_line/checkpoint.pt"
    assert [line for line in lines if stopped in line] == [stopped + "; continue with --resume"]


def test_a_hub_id_without_network_is_one_line_at_once(tmp_path, monkeypatch, capsys, gsm8k_dirs):
    import huggingface_hub.constants

    def unreachable(address, timeout=None, **kwargs):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(train.socket, "create_connection", unreachable)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for name in train.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    start = time.perf_counter()
    flags = ["--model", "nobody/no-such-model", "--task", "gsm8k", "--task-source", gsm8k_dirs[1]]
    flags += ["--device", "cpu", "--out-dir", str(tmp_path / "runs")]
    code, out, err = main_exit(flags, capsys)
    assert time.perf_counter() - start < 10  # no retries
    # (above the line: datasets' progress bar of the local GSM8K file)
    last_line = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err and last_line.startswith("train.py: error: ")
    assert "argument --model: nobody/no-such-model is not in the local Hugging Face cache" in err
    assert "huggingface.co cannot be reached" in err and "give a local directory" in err

    # a snapshot in the cache is used as it is, without the network
    snapshot = tmp_path / "hub" / "models--nobody--cached" / "snapshots" / "0123abcd"
    os.makedirs(snapshot)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--nobody--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--nobody--cached" / "refs" / "main").write_text("0123abcd")
    assert train.model_source("nobody/cached") == str(snapshot)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert train.model_source("nobody/cached") == str(snapshot)
    with pytest.raises(runs.ConfigError, match="HF_HUB_OFFLINE is set"):
        train.model_source("nobody/no-such-model")


def test_the_update_hands_the_loss_dual_clip_and_the_reference_kl(monkeypatch):
    """--clip-ratio-c and --kl-coef reach grpo.policy_loss, the latter with the starting policy's
    log-probs (a frozen copy of the warm-start: its KL to the trainer is 0 before the first
    step)."""
    seen = []
    original = grpo.policy_loss

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(grpo, "policy_loss", spy)
    cfg, trainer, seq, advantages = update_fixture(clip_ratio_c=2.5, kl_coef=0.1)
    reference = copy.deepcopy(trainer)
    reference_logp = train.no_grad_logprobs(cfg, reference, seq, None)[0]
    _, _, stats = train.policy_update(
        cfg, trainer, adamw(cfg, trainer), seq, advantages, 0, reference_logp=reference_logp
    )
    assert seen[0]["clip_ratio_c"] == 2.5 and seen[0]["kl_coef"] == 0.1
    assert torch.equal(seen[0]["ref_logprobs"], reference_logp)
    assert stats[0]["kl"] == 0.0  # the trainer is still the starting policy
    seen.clear()
    no_kl = dataclasses.replace(cfg, kl_coef=0.0)
    train.policy_update(no_kl, trainer, adamw(cfg, trainer), seq, advantages, 0)
    assert seen[0]["ref_logprobs"] is None and seen[0]["kl_coef"] == 0.0


def test_no_warm_start_steps_keep_the_model_as_built_and_write_no_cache(tmp_path):
    cfg = tiny_config(tmp_path, warmstart_steps=0)
    task = train.build_task(cfg)
    model, tokenizer = train.build_model(cfg, task)
    before = copy.deepcopy(model.state_dict())
    train.warmstart(cfg, model, task, tokenizer)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert not os.path.exists(cfg.warmstart_dir)  # a real checkpoint is not copied into the cache


def test_no_eval_trainer_logs_the_rollouts_pass_at_1_alone_and_holds_no_copy(tmp_path, capsys):
    cfg = tiny_config(tmp_path, eval_trainer=False, steps=2, eval_every=2)
    s = train.setup(cfg)
    assert s.eval_model is None
    run_dir = train.run(cfg)
    evals = [r for r in read_metrics(run_dir) if "pass@1" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert not any("bf16_trainer" in key for r in evals for key in r)
    assert "pass@1        rollout" in capsys.readouterr().out  # the summary without the copy


def test_gsm8k_without_the_datasets_package_is_one_error_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    cfg = train.TrainConfig(
        task="gsm8k", task_source="gsm8k.jsonl", model=str(tmp_path), device="cpu"
    )
    with pytest.raises(train.ConfigError) as error:
        train.build_task(cfg)
    assert str(error.value) == (
        "argument --task: gsm8k loads its problems with the `datasets` package, which is not "
        "installed (pip install datasets)"
    )
