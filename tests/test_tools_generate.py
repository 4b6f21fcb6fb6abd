"""tools/generate.py: completions of a run's checkpoint equal a plain decoding loop over the model
(greedy), carry the log-probs of their tokens (sampled), in the rollout precision asked for; a
Hugging Face directory works as a run does; bad flags are one line."""

import copy
import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F

import moe
import rac
import tasks
import train
from tools import export, generate

VOCAB = 17  # the arith task's character tokenizer
TOKENIZER = tasks.make_task("arith").tokenizer


@pytest.fixture(scope="module")
def arith_run(tmp_path_factory):
    """A run directory whose checkpoint holds a tiny random policy (N(0, 0.3): its routes vary)."""
    directory = tmp_path_factory.mktemp("generate") / "run"
    os.makedirs(directory)
    torch.manual_seed(0)
    model = moe.MoETransformer(moe.MoEConfig.from_preset("tiny", vocab_size=VOCAB))
    model.init_weights(std=0.3)
    cfg = train.TrainConfig(
        device="cpu", out_dir=str(directory.parent), difficulty=1, max_new_tokens=12
    )
    ckpt = {"step": 5, "trainer": model.state_dict(), "optimizer": {}}
    torch.save(
        {**ckpt, "config": dataclasses.asdict(cfg)}, os.path.join(directory, "checkpoint.pt")
    )
    with open(os.path.join(directory, "config.json"), "w") as f:  # as every run has
        json.dump(dataclasses.asdict(cfg), f)
    return str(directory), model


def run_main(argv, capsys):
    try:
        result, code = generate.main(argv), 0
    except SystemExit as stop:
        result, code = None, stop.code
    out, err = capsys.readouterr()
    return code, out, err, result


def greedy_loop(model, prompt_ids, max_new_tokens, eos_id):
    """The oracle: the whole sequence through the model at each step, its most likely next token."""
    ids, logprobs = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logp = F.log_softmax(model(torch.tensor([ids]))[0, -1].float(), dim=-1)
            token = int(logp.argmax())
            ids.append(token)
            logprobs.append(logp[token].item())
            if token == eos_id:
                break
    return ids[len(prompt_ids) :], sum(logprobs) / len(logprobs)


def mean_logprob(model, prompt_ids, completion_ids, temperature=1.0):
    """The oracle: one forward over prompt + completion, its tokens' mean tempered log-prob."""
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt_ids) - 1 : -1].float() / temperature
    logp = F.log_softmax(logits, dim=-1).gather(-1, ids[0, len(prompt_ids) :, None])
    return logp.mean().item()


def test_greedy_completion_is_the_plain_decoding_loop(arith_run, capsys):
    run, model = arith_run
    code, out, _, results = run_main([run, "--prompt", "12+34=", "--greedy"], capsys)
    prompt = TOKENIZER.encode("12+34=")
    ids, mean = greedy_loop(model, prompt, 12, TOKENIZER.eos_id)  # the run's --max-new-tokens
    assert code == 0 and len(results) == 1
    assert results[0].ids == ids and results[0].text == TOKENIZER.decode(ids)
    assert results[0].ended == (ids[-1] == TOKENIZER.eos_id)
    assert results[0].mean_logprob == pytest.approx(mean, abs=1e-5)
    assert f"{run} (step 5): '12+34=', bf16 rollout, greedy, cpu" in out
    assert f"--- 1: {len(ids)} tokens" in out and results[0].text in out


def test_samples_carry_their_log_probs_and_follow_the_seed(arith_run, capsys):
    run, model = arith_run
    argv = [run, "--prompt", "7+8=", "--temperature", "0.7", "--max-new-tokens", "6"]
    _, _, _, first = run_main(argv, capsys)
    _, _, _, again = run_main(argv, capsys)
    _, _, _, other = run_main(argv + ["--seed", "1"], capsys)
    assert len(first) == generate.DEFAULT_SAMPLES and first == again
    assert [c.ids for c in first] != [c.ids for c in other]
    prompt = TOKENIZER.encode("7+8=")
    for completion in first:
        assert 1 <= len(completion.ids) <= 6
        expected = mean_logprob(model, prompt, completion.ids, temperature=0.7)
        assert completion.mean_logprob == pytest.approx(expected, abs=1e-5)


def test_the_rollout_precision_is_the_one_asked_for(arith_run, capsys):
    run, model = arith_run
    # NVFP4 weights with unquantized activations: decode and one prefill agree (a W4A4 rollout's
    # per-tensor activation scale would make a token's rounding depend on its batch)
    argv = [run, "--prompt", "12+34=", "--n", "2", "--precision", "w4a16"]
    _, out, _, results = run_main(argv, capsys)
    assert "w4a16 rollout" in out
    w4a16_model = rac.convert_for_rollout(copy.deepcopy(model), "w4a16")
    prompt = TOKENIZER.encode("12+34=")
    for completion in results:
        w4a16_logprob = mean_logprob(w4a16_model, prompt, completion.ids)
        assert completion.mean_logprob == pytest.approx(w4a16_logprob, abs=1e-5)
        assert abs(mean_logprob(model, prompt, completion.ids) - w4a16_logprob) > 1e-3
    # RAC's blocks are chosen on the prompt: every selector calibrated, round(0.5 G) blocks each
    converted = generate.rollout_model(copy.deepcopy(model), "nvfp4", 0.5, "tensor", prompt, "cpu")
    selectors = [m for m in converted.modules() if isinstance(m, rac.RACSelector)]
    assert selectors and all(s.calibrated and int(s.mask.sum()) == s.n_selected for s in selectors)
    assert all(s.n_selected == int(0.5 * s.n_blocks + 0.5) for s in selectors)


def test_a_hugging_face_directory_completes_as_its_model(tmp_path, capsys):
    shape = "dim=32,n_heads=2,n_kv_heads=1,head_dim=16,n_experts=4,n_active=2,expert_dim=16"
    directory = export.random_checkpoint(
        str(tmp_path / "hf"), 1, shape + ",vocab_size=128", task_rows=100
    )
    code, _, _, results = run_main(
        [directory, "--prompt", "What is 2+3?", "--greedy", "--max-new-tokens", "5"], capsys
    )
    model, hf_tokenizer = moe.load_hf(directory)
    tokenizer = tasks.HFTokenizer(hf_tokenizer)
    ids, _ = greedy_loop(model, tokenizer.encode("What is 2+3?"), 5, tokenizer.eos_id)
    assert code == 0 and results[0].ids == ids and results[0].text == tokenizer.decode(ids)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--prompt", ""], "argument --prompt: must be some text, got ''"),
        (["--prompt", "12*3="], "argument --prompt: character '*' is not in the alphabet"),
        (["--prompt", "1+2=", "--n", "0"], "argument --n: must be >= 1, got 0"),
        (["--prompt", "1+2=", "--greedy", "--n", "3"], "argument --n: 3 with --greedy"),
        (
            ["--prompt", "1+2=", "--greedy", "--temperature", "1"],
            "argument --temperature: not allowed with argument --greedy",
        ),
        (
            ["--prompt", "1+2=", "--temperature", "0"],
            "argument --temperature: must be a number > 0",
        ),
        (["--prompt", "1+2=", "--precision", "fp4"], "argument --precision: choose from bf16, fp8"),
        (
            ["--prompt", "1+2=", "--rac-ratio", "0.5"],
            "argument --rac-ratio: compensates NVFP4 activations; --precision bf16 has none",
        ),
        (["--prompt", "1+2=", "--rac-ratio", "2", "--precision", "nvfp4"], "must be in [0, 1]"),
        (
            ["--prompt", "1+2=", "--act-scale", "row"],
            "argument --act-scale: 'row' scales NVFP4 activations; --precision bf16 has none",
        ),
        (
            ["--prompt", "1+2=", "--max-new-tokens", "300"],
            "argument --max-new-tokens: 4 prompt + 300 new tokens exceed the model's "
            "max_seq_len=256 (at most 252 new tokens)",
        ),
        (["--prompt", "1+2=", "--device", "tpu"], "argument --device: choose from cpu, cuda"),
    ],
)
def test_bad_arguments_are_one_line(arith_run, capsys, argv, message):
    code, out, err, _ = run_main([arith_run[0]] + argv, capsys)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert out == ""


def test_a_run_or_directory_that_cannot_be_read_is_one_line(tmp_path, capsys):
    code, _, err, _ = run_main([str(tmp_path), "--prompt", "1+2="], capsys)
    assert code == 2 and f"argument RUN: no checkpoint at '{tmp_path}'" in err
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    code, _, err, _ = run_main([str(tmp_path), "--prompt", "1+2="], capsys)
    assert code == 2 and err.count("\n") == 1 and f"argument RUN: cannot load {tmp_path}" in err
