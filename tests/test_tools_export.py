"""tools/export.py: a run's export loads in transformers with the project's logits and back through
moe.load_hf; sharding, a --model run's tokenizer, directories never replaced unasked; the random
checkpoint at real (here shrunk) shapes loads through train.py's path."""

import dataclasses
import json
import os

import pytest
import torch
import transformers
from conftest import report_diff
from safetensors import safe_open

import moe
import train
from tools import export, runs

VOCAB = 17  # the arith task's character tokenizer


def write_run(directory, policy, **train_config):
    """A run directory holding a train.py checkpoint of `policy` (step 7)."""
    cfg = train.TrainConfig(device="cpu", out_dir=str(directory), **train_config)
    os.makedirs(directory, exist_ok=True)
    ckpt = {
        "step": 7,
        "trainer": policy.state_dict(),
        "optimizer": {},
        "config": dataclasses.asdict(cfg),
    }
    torch.save(ckpt, os.path.join(directory, "checkpoint.pt"))
    return str(directory)


def arith_run(directory, overrides=""):
    """A tiny-preset run with weights wide enough (N(0, 0.3)) that routing depends on them."""
    fields = runs.preset_overrides("tiny", overrides)
    torch.manual_seed(0)
    model = moe.MoETransformer(moe.MoEConfig.from_preset("tiny", vocab_size=VOCAB, **fields))
    model.init_weights(std=0.3)
    return write_run(directory, model, preset_overrides=overrides), model


def main_exit(argv, capsys):
    try:
        result, code = export.main(argv), 0
    except SystemExit as stop:
        result, code = None, stop.code
    out, err = capsys.readouterr()
    return code, out, err, result


def tree(directory):
    """{relative path: bytes} of every file under directory."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, directory)] = f.read()
    return files


def same_weights(model, other):
    state, other_state = model.state_dict(), other.state_dict()
    return state.keys() == other_state.keys() and all(
        torch.equal(state[name], other_state[name]) for name in state
    )


# ----------------------------------------------------------------------------- a run's export
@pytest.mark.parametrize("overrides", ["", "tie_embeddings=true"], ids=["untied", "tied"])
def test_export_loads_in_transformers_with_the_projects_logits(tmp_path, capsys, overrides):
    run, model = arith_run(tmp_path / "run", overrides)
    code, out, _, exported = main_exit([run], capsys)
    assert code == 0 and exported == os.path.join(run, "export_step7")
    assert export.NO_TOKENIZER in out  # the arith tokenizer has no Hugging Face form
    assert sorted(os.listdir(exported)) == ["config.json", "model.safetensors"]
    with open(os.path.join(exported, "config.json")) as f:
        hub = json.load(f)
    assert hub["num_experts"] == 8 and hub["head_dim"] == 16 and hub["torch_dtype"] == "float32"
    assert hub["tie_word_embeddings"] == bool(overrides)

    hf_model, loading = transformers.AutoModelForCausalLM.from_pretrained(
        exported, dtype=torch.float32, output_loading_info=True
    )
    assert not any(loading.values()), loading  # no missing, unexpected or mismatched tensors
    tokens = torch.randint(VOCAB, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        max_diff, _ = report_diff(hf_model.eval()(tokens).logits, model(tokens), "export vs moe")
    assert max_diff < 1e-5

    reloaded, tokenizer = moe.load_hf(
        exported
    )  # and back: the same config and weights, bit for bit
    assert tokenizer is None and reloaded.config == model.config and same_weights(reloaded, model)


def test_bfloat16_export_holds_the_master_weights_rounded(tmp_path):
    run, model = arith_run(tmp_path / "run")
    exported = export.export_run(run, str(tmp_path / "bf16"), dtype="bfloat16")
    reloaded, _ = moe.load_hf(exported, dtype=torch.bfloat16)
    assert same_weights(reloaded, model.to(torch.bfloat16))
    with open(os.path.join(exported, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"


def test_a_large_checkpoint_is_sharded_with_an_index(tmp_path):
    run, model = arith_run(tmp_path / "run")
    exported = export.export_run(run, str(tmp_path / "sharded"), max_shard_bytes=40_000)
    with open(os.path.join(exported, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert (
        len(shards) > 2
        and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    )
    assert sorted(os.listdir(exported)) == sorted(
        shards + ["config.json", "model.safetensors.index.json"]
    )
    total, names = 0, set()
    for shard in shards:
        path = os.path.join(exported, shard)
        assert os.path.getsize(path) < 40_000 + 4096  # its tensors, plus the header
        with safe_open(path, framework="pt") as f:
            names |= set(f.keys())
            total += sum(f.get_tensor(name).numel() * 4 for name in f.keys())
    assert names == set(index["weight_map"]) and index["metadata"]["total_size"] == total
    assert total == 4 * model.num_params()
    reloaded, _ = moe.load_hf(exported)
    assert same_weights(reloaded, model)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    tokens = torch.randint(VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (hf_model.eval()(tokens).logits - model(tokens)).abs().max() < 1e-5


def source_checkpoint(directory):
    """A tiny random Qwen3-MoE with a tokenizer, as a --model run starts from."""
    tokenizer = export.char_tokenizer(128)
    tokenizer.save_pretrained(directory)
    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        max_position_embeddings=128,
        norm_topk_prob=True,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(hf_config).save_pretrained(directory)
    return str(directory)


def test_a_model_run_exports_its_trained_weights_with_the_source_tokenizer(tmp_path):
    source = source_checkpoint(tmp_path / "source")
    trained, _ = moe.load_hf(source)
    with torch.no_grad():  # the run moved the weights away from its source's
        for p in trained.parameters():
            p.add_(0.1 * torch.randn_like(p))
    run = write_run(tmp_path / "run", trained, model=source, task="gsm8k")
    exported = export.export_run(run, str(tmp_path / "out"))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # copied as they are
        with (
            open(os.path.join(source, name), "rb") as a,
            open(os.path.join(exported, name), "rb") as b,
        ):
            assert a.read() == b.read()
    with (
        open(os.path.join(source, "config.json")) as a,
        open(os.path.join(exported, "config.json")) as b,
    ):
        source_config, exported_config = json.load(a), json.load(b)
    assert exported_config["torch_dtype"] == "float32"
    assert {k: v for k, v in exported_config.items() if k != "torch_dtype"} == {
        k: v for k, v in source_config.items() if k not in ("torch_dtype", "dtype")
    }
    reloaded, tokenizer = moe.load_hf(exported)
    assert same_weights(reloaded, trained) and not same_weights(reloaded, moe.load_hf(source)[0])
    assert tokenizer.decode(tokenizer.encode("#### 42")) == "#### 42"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    tokens = torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf_model.eval()(tokens).logits - trained(tokens)).abs().max() < 1e-5


# ----------------------------------------------------------------------------- directories
def test_an_export_never_replaces_a_directory_unasked(tmp_path, capsys, monkeypatch):
    run, _ = arith_run(tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, _, err, _ = main_exit([run, "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"argument --out: {out} exists: add --overwrite to replace it" in err
    assert tree(out) == {"notes.txt": b"keep me"}
    # neither the run nor a directory holding it, even with --overwrite
    before = tree(run)
    for target in (run, str(tmp_path)):
        code, _, err, _ = main_exit([run, "--out", target, "--overwrite"], capsys)
        assert code == 2 and f"would replace {run}" in err and tree(run) == before
    # a failed write leaves what was there, and no temporary directory beside it

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(export, "write_safetensors", fail)
    with pytest.raises(OSError):
        export.export_run(run, str(out), overwrite=True)
    assert tree(out) == {"notes.txt": b"keep me"}
    assert sorted(os.listdir(tmp_path)) == ["out", "run"]
    monkeypatch.undo()
    assert main_exit([run, "--out", str(out), "--overwrite"], capsys)[0] == 0  # asked: replaced
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "argument RUN: give a run directory, or --random-layers N --out DIR"),
        (["/nonexistent/run"], "argument RUN: no checkpoint at '/nonexistent/run'"),
        (["RUN", "--dtype", "float16"], "argument --dtype: choose from float32, bfloat16"),
        (["RUN", "--shape", "dim=64"], "argument --shape: --shape, --seed and --task-rows apply"),
        (["RUN", "--random-layers", "2"], "argument --random-layers: writes random weights"),
        (["--random-layers", "2"], "argument --out: --random-layers needs the directory"),
        (["--random-layers", "0", "--out", "X"], "argument --random-layers: must be >= 1, got 0"),
        (
            ["--random-layers", "1", "--out", "X", "--shape", "n_layers=4"],
            "argument --shape: the number of layers is --random-layers N",
        ),
        (
            ["--random-layers", "1", "--out", "X", "--shape", "dim=100"],
            "argument --shape: dim = 100 must be a multiple of 16",
        ),
        (
            ["--random-layers", "1", "--out", "X", "--shape", "vocab_size=50"],
            "argument --shape: vocab_size must be an integer >= 99",
        ),
        (
            ["--random-layers", "1", "--out", "X", "--task-rows", "5"],
            "argument --task-rows: must be an integer >= 100",
        ),
    ],
)
def test_bad_arguments_are_one_line(tmp_path, capsys, argv, message):
    run, _ = arith_run(tmp_path / "run")
    argv = [run if word == "RUN" else word for word in argv]
    argv = [str(tmp_path / "x") if word == "X" else word for word in argv]
    code, _, err, _ = main_exit(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "x").exists() and os.listdir(run) == ["checkpoint.pt"]


# ----------------------------------------------------------------------------- a random checkpoint
SHRUNK = "dim=64,n_heads=4,n_kv_heads=2,head_dim=16,n_experts=8,n_active=2,expert_dim=32"


def test_random_checkpoint_loads_through_train_pys_path(tmp_path, capsys):
    out = str(tmp_path / "random")
    code, printed, _, _ = main_exit(
        ["--random-layers", "2", "--out", out, "--shape", SHRUNK + ",vocab_size=512"], capsys
    )
    assert code == 0 and f"--model {out} --task gsm8k --task-source {out}/gsm8k.jsonl" in printed
    task_file = os.path.join(out, "gsm8k.jsonl")
    cfg = train.TrainConfig(model=out, task="gsm8k", task_source=task_file, device="cpu")
    task = train.build_task(cfg)
    model, tokenizer = train.build_model(cfg, task)  # moe.load_hf and the tokenizer's checks
    expected = moe.MoEConfig.from_preset(
        "qwen3-30b-a3b", n_layers=2, vocab_size=512, **runs.preset_overrides("tiny", SHRUNK)
    )
    assert model.config == expected and tokenizer.vocab_size == 512
    # every character of the task encodes (none is <unk>), and every id the model samples decodes
    hf_tokenizer = tokenizer.tokenizer
    for problem in task.sample(20, "train") + task.sample(5, "test"):
        text = problem.prompt + problem.solution
        ids = tokenizer.encode(text)
        assert hf_tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text
    assert len(tokenizer.decode(list(range(3, 512)))) > 0
    # Hugging Face's init: unit norms, N(0, 0.02) matrices, in BF16
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        norm = f.get_tensor("model.layers.1.input_layernorm.weight")
        expert = f.get_tensor("model.layers.0.mlp.experts.5.up_proj.weight")
    assert norm.dtype == torch.bfloat16 and torch.equal(norm, torch.ones(64, dtype=torch.bfloat16))
    assert expert.shape == (32, 64) and abs(expert.float().std().item() - 0.02) < 0.002


def test_random_checkpoint_is_a_function_of_its_seed(tmp_path):
    shape = SHRUNK + ",vocab_size=128"
    first = tree(export.random_checkpoint(str(tmp_path / "a"), 1, shape, seed=3, task_rows=100))
    again = tree(export.random_checkpoint(str(tmp_path / "b"), 1, shape, seed=3, task_rows=100))
    other = tree(export.random_checkpoint(str(tmp_path / "c"), 1, shape, seed=4, task_rows=100))
    assert first == again
    assert first["model.safetensors"] != other["model.safetensors"]
    assert first["gsm8k.jsonl"] != other["gsm8k.jsonl"]


def test_the_hub_config_at_full_shape_is_qwen3_30b_a3bs():
    """config.json of the random checkpoint at 48 layers, read by transformers, is the preset (the
    shapes of Qwen/Qwen3-30B-A3B's own config.json)."""
    preset = moe.PRESETS["qwen3-30b-a3b"]
    hub = export.hub_config(preset, torch.bfloat16, {"eos_token_id": 1})
    hf_config = transformers.Qwen3MoeConfig(**hub)
    assert moe.config_from_hf(hf_config) == preset
    assert (hub["hidden_size"], hub["num_experts"], hub["num_experts_per_tok"]) == (2048, 128, 8)
    assert (hub["moe_intermediate_size"], hub["num_attention_heads"]) == (768, 32)
    assert (hub["num_key_value_heads"], hub["head_dim"], hub["vocab_size"]) == (4, 128, 151936)
