"""A run's policy as a Hugging Face Qwen3-MoE checkpoint, or random weights at real shapes.

    python -m tools.export runs/quads                     # -> runs/quads/export_step<N>/, FP32
    python -m tools.export runs/quads --out DIR --dtype bfloat16
    python -m tools.export --random-layers 4 --out DIR    # random, Qwen3-30B-A3B's layer shapes
    python -m tools.export --random-layers 2 --out DIR --shape dim=256,n_experts=16,vocab_size=4096

A run exports its checkpoint's trainer weights (the FP32 master weights; a QAT trainer keeps
moe.py's names) in the layout of the hub's Qwen3-MoE checkpoints, which transformers loads with the
project's logits (tested) and vLLM and lm-eval read (not tried here):

    config.json          the hub's Qwen3-MoE keys (a --model run: its source's file, dtype updated)
    model.safetensors    or model-0000i-of-0000N.safetensors and model.safetensors.index.json,
                         at most MAX_SHARD_BYTES a file
    tokenizer files      a --model run's, copied from its source; the arith task's character
                         tokenizer has no Hugging Face form, so that export has none (it says so)

Names, moe.py -> hub: embed -> model.embed_tokens; layers.i.attn_norm and mlp_norm ->
model.layers.i.input_layernorm and post_attention_layernorm; attn.{q,k,v,o}_proj and
attn.{q,k}_norm -> self_attn.*; mlp.gate -> mlp.gate; norm -> model.norm; lm_head -> lm_head
(absent when tied). The experts are stored a matrix per expert, as the hub's checkpoints are
(transformers 5 fuses them on load; moe.load_hf reads both layouts):

    gate_up_proj (E, 2I, D) -> mlp.experts.e.gate_proj.weight = [e, :I], up_proj.weight = [e, I:]
    down_proj    (E, D, I)  -> mlp.experts.e.down_proj.weight = [e]

The random checkpoint stands in for Qwen3-30B-A3B where its 61 GB are not wanted: the hub's
shapes (dim 2048, 128 experts top-8 of width 768, 32 query and 4 key/value heads of 128, a
vocabulary of 151,936) with fewer layers; N(0, 0.02) matrices and unit norms (Hugging Face's
init) in BF16, made and written a tensor at a time. Beside it: a character tokenizer padded to the
model's vocabulary (every id decodes) and gsm8k.jsonl, GSM8K-format word problems, so that
`python train.py --model DIR --task gsm8k --task-source DIR/gsm8k.jsonl` runs offline. What it
writes means nothing; its memory and time are those of the real model's layers.

A directory is written whole or not at all (into a temporary sibling, renamed at the end); one
that exists is replaced only with --overwrite, never the run itself or the model it started from.
Left out: quantized exports (NVFP4 weights in a serving format), the optimizer state, chat
templates.
"""

import argparse
import json
import os
import random
import shutil
import string
import sys
from typing import NamedTuple

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # also as a plain script

import torch  # noqa: E402

import moe  # noqa: E402
from tools import runs  # noqa: E402

MAX_SHARD_BYTES = 5 * 10**9  # hub checkpoints hold a few GB a file
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# What a --model run's source brings beside its weights: its tokenizer and generation defaults.
SOURCE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
NO_TOKENIZER = (
    "the arith task's character tokenizer has no Hugging Face form: the model is written "
    "without one (its ids are tasks.CharTokenizer's: 0 pad, 1 bos, 2 eos, then '0123456789+=;>')"
)


# ----------------------------------------------------------------------------- a run's policy
class RunPolicy(NamedTuple):
    model: moe.MoETransformer  # the trainer's FP32 master weights, on the CPU
    step: int  # the checkpoint's RL step
    train_config: dict  # the run's TrainConfig, as its checkpoint stores it
    source: str | None  # a --model run: the local directory of the checkpoint it started from


def read_run(path: str) -> RunPolicy:
    """A run directory (its checkpoint.pt) or a checkpoint file -> its policy as a moe.py model."""
    ckpt_path = path if os.path.isfile(path) else os.path.join(path, "checkpoint.pt")
    refuse_run(
        not os.path.isfile(ckpt_path),
        f"no checkpoint at {path!r}; give a run directory holding checkpoint.pt, or a checkpoint",
    )
    ckpt = runs.load_checkpoint(ckpt_path, "cpu", "give another run directory or checkpoint")
    train_config, state = ckpt["config"], ckpt["trainer"]
    source = source_directory(train_config["model"]) if train_config.get("model") else None
    if source is not None:
        from transformers import AutoConfig

        config = moe.config_from_hf(AutoConfig.from_pretrained(source))
    else:
        # a preset run's vocabulary is its task's tokenizer's: the embedding's rows say it
        overrides = runs.preset_overrides(
            train_config["preset"], train_config.get("preset_overrides", "")
        )
        vocab_size = state["embed.weight"].shape[0]
        config = moe.MoEConfig.from_preset(
            train_config["preset"], vocab_size=vocab_size, **overrides
        )
    with torch.device("meta"):  # no memory for weights that are about to be replaced
        model = moe.MoETransformer(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in state.items()}
    refuse_run(
        expected != found,
        f"the checkpoint {ckpt_path} does not hold a {config}: "
        f"missing {sorted(set(expected) - set(found))}, "
        f"unexpected {sorted(set(found) - set(expected))}, "
        f"other shapes {sorted(n for n in expected if n in found and expected[n] != found[n])}",
    )
    model.load_state_dict(state, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return RunPolicy(model.float(), ckpt["step"], train_config, source)


def refuse_run(bad: bool, why: str):
    """The positional argument's one-line error (runs.refuse names --flags)."""
    if bad:
        raise runs.ConfigError(f"argument RUN: {why}")


def source_directory(model: str) -> str:
    """The directory of a --model run's starting checkpoint: itself, or the hub's files in the
    local cache (config and tokenizer only: the weights are the run's)."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, allow_patterns=["*.json", "*.txt", "*.jinja", "*.model"])
    except Exception as error:  # offline, no such repository: the hub's errors have many types
        raise runs.ConfigError(
            f"argument RUN: the run started from {model}, which is neither a directory nor "
            f"reachable on the hub ({runs.one_line(error)})"
        ) from None


# ----------------------------------------------------------------------------- the hub's names
def hub_config(config: moe.MoEConfig, dtype: torch.dtype, token_ids: dict) -> dict:
    """config.json as the hub writes Qwen3-MoE's (num_experts, rope_theta: what readers know)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "num_experts": config.n_experts,
        "num_experts_per_tok": config.n_active,
        "moe_intermediate_size": config.expert_dim,
        # the width of dense-MLP layers; there are none (mlp_only_layers is empty)
        "intermediate_size": config.expert_dim,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": config.norm_topk_prob,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": config.rms_eps,
        "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": 0.02,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
        **token_ids,
    }


def hub_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One moe.py state-dict entry -> its hub names and tensors (the experts split per expert)."""
    parts = name.split(".")
    if parts[0] == "embed":
        return [("model.embed_tokens.weight", tensor)]
    if parts[0] == "norm":
        return [("model.norm.weight", tensor)]
    if parts[0] == "lm_head":
        return [("lm_head.weight", tensor)]
    prefix = f"model.layers.{parts[1]}"
    module = ".".join(parts[2:])
    if module == "attn_norm.weight":
        return [(f"{prefix}.input_layernorm.weight", tensor)]
    if module == "mlp_norm.weight":
        return [(f"{prefix}.post_attention_layernorm.weight", tensor)]
    if parts[2] == "attn":
        return [(f"{prefix}.self_attn.{'.'.join(parts[3:])}", tensor)]
    if module == "mlp.gate.weight":
        return [(f"{prefix}.mlp.gate.weight", tensor)]
    if module == "mlp.experts.gate_up_proj":
        gate, up = tensor.chunk(2, dim=1)  # (E, I, D) each
        return [
            (f"{prefix}.mlp.experts.{e}.{projection}.weight", matrix[e])
            for e in range(tensor.shape[0])
            for projection, matrix in (("gate_proj", gate), ("up_proj", up))
        ]
    if module == "mlp.experts.down_proj":
        return [
            (f"{prefix}.mlp.experts.{e}.down_proj.weight", tensor[e])
            for e in range(tensor.shape[0])
        ]
    raise ValueError(f"hub_tensors: moe.py has no parameter {name!r}")


def model_tensors(model: moe.MoETransformer):
    """(name, tensor) in state-dict order, a tied LM head left out (the hub omits it)."""
    for name, tensor in model.state_dict().items():
        if not (model.config.tie_embeddings and name == "lm_head.weight"):
            yield name, tensor


# ----------------------------------------------------------------------------- writing
def write_safetensors(named_tensors, directory: str, dtype: torch.dtype, max_shard_bytes: int):
    """Write (moe.py name, tensor) pairs as hub tensors into directory, a new shard whenever the
    next tensor would pass max_shard_bytes; one shard is model.safetensors, several get an index.
    -> the files written."""
    from safetensors.torch import save_file

    shards = []  # (temporary file, its hub names), in order

    def flush(shard):
        temporary = os.path.join(directory, f"shard{len(shards)}.tmp")
        save_file(shard, temporary, metadata={"format": "pt"})
        shards.append((temporary, list(shard)))

    shard, shard_bytes, total_bytes = {}, 0, 0
    for name, tensor in named_tensors:
        for hub_name, part in hub_tensors(name, tensor):
            part = part.detach().to(dtype).contiguous()
            size = part.numel() * part.element_size()
            if shard and shard_bytes + size > max_shard_bytes:
                flush(shard)
                shard, shard_bytes = {}, 0
            shard[hub_name] = part
            shard_bytes += size
            total_bytes += size
    flush(shard)
    weight_map = {}
    files = []
    for index, (temporary, names) in enumerate(shards):
        file = "model.safetensors"
        if len(shards) > 1:
            file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(temporary, os.path.join(directory, file))
        weight_map.update({name: file for name in names})
        files.append(file)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        runs.write_text(
            json.dumps(index, indent=2), os.path.join(directory, "model.safetensors.index.json")
        )
        files.append("model.safetensors.index.json")
    return files


def check_out(out: str, overwrite: bool, keep: list[str]):
    """Refuse, before any work, to write where something is (unless overwrite), or to replace `keep`
    (the run, the model it started from) or a directory holding one of them."""
    runs.refuse(
        os.path.exists(out) and not os.path.isdir(out),
        "out",
        f"{out} is a file; give a directory",
    )
    runs.refuse(
        os.path.exists(out) and not overwrite,
        "out",
        f"{out} exists: add --overwrite to replace it, or give another --out",
    )
    target = os.path.realpath(out)
    for path in keep:
        inside = os.path.realpath(path)
        runs.refuse(
            inside == target or inside.startswith(target + os.sep),
            "out",
            f"{out} would replace {path}; give a directory of its own",
        )


def write_directory(out: str, fill):
    """fill(directory) writes into a temporary sibling of out, which then becomes out: a reader sees
    the old directory or the new one, never half of one. -> out"""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    temporary = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.tmp.{os.getpid()}")
    old = f"{temporary}.old"
    shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    try:
        fill(temporary)
        if os.path.isdir(out):
            os.rename(out, old)
        os.rename(temporary, out)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out


def export_run(
    path: str,
    out: str = "",
    dtype: str = "float32",
    overwrite: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> str:
    """Write the policy of the run at `path` as a Hugging Face checkpoint -> its directory."""
    runs.require(dtype in DTYPES, "dtype", dtype, f"choose from {', '.join(DTYPES)}")
    policy = read_run(path)
    run_dir = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    out = out or os.path.join(run_dir, f"export_step{policy.step}")
    keep = [run_dir]  # and the model a --model run started from
    if policy.source is not None:
        keep.append(policy.source)
    check_out(out, overwrite, keep)
    torch_dtype = DTYPES[dtype]
    config = policy.model.config

    def fill(directory):
        if policy.source is None:
            print(NO_TOKENIZER)
            token_ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
            hub = hub_config(config, torch_dtype, token_ids)
        else:  # the source's own config.json: its token ids and whatever else readers look for
            with open(os.path.join(policy.source, "config.json")) as f:
                hub = json.load(f)
            hub["torch_dtype"] = dtype
            hub.pop("dtype", None)  # transformers 5's name for it; one of the two is enough
            for name in SOURCE_FILES:
                if os.path.isfile(os.path.join(policy.source, name)):
                    shutil.copy(os.path.join(policy.source, name), directory)
        runs.write_text(json.dumps(hub, indent=2), os.path.join(directory, "config.json"))
        write_safetensors(model_tensors(policy.model), directory, torch_dtype, max_shard_bytes)

    write_directory(out, fill)
    print(f"exported step {policy.step} of {run_dir} ({dtype}) to {out}")
    return out


# ----------------------------------------------------------------------------- a random model
def shape_overrides(text: str) -> dict:
    """--shape "dim=256,vocab_size=4096" -> the moe.MoEConfig fields it replaces in Qwen3-30B-A3B's,
    checked as train.py's --preset-overrides are (vocab_size allowed: here there is no task's)."""
    items = [item for item in text.split(",") if item]
    vocab = [item for item in items if item.partition("=")[0] == "vocab_size"]
    others = ",".join(item for item in items if item not in vocab)
    runs.refuse(
        "n_layers=" in others,
        "shape",
        "the number of layers is --random-layers N",
    )
    try:
        overrides = runs.preset_overrides("qwen3-30b-a3b", others)
    except runs.ConfigError as error:
        raise runs.ConfigError(str(error).replace("--preset-overrides", "--shape")) from None
    for item in vocab:
        value = item.partition("=")[2]
        runs.require(
            value.isdigit() and int(value) >= len(TOKENIZER_BASE),
            "shape",
            text,
            f"vocab_size must be an integer >= {len(TOKENIZER_BASE)} (the tokenizer's characters)",
        )
        overrides["vocab_size"] = int(value)
    return overrides


SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
# every character a word problem, its solution and GSM8K's instruction use (string.printable's
# whitespace narrowed to space and newline)
CHARACTERS = string.ascii_letters + string.digits + string.punctuation + " \n"
TOKENIZER_BASE = SPECIAL_TOKENS + tuple(CHARACTERS)


def char_tokenizer(vocab_size: int):
    """A character tokenizer padded to vocab_size with <|extra_i|> tokens, so that every id the
    random model samples decodes; pad, eos and unk are ids 0, 1 and 2."""
    import tokenizers
    import transformers

    fillers = [f"<|extra_{i}|>" for i in range(vocab_size - len(TOKENIZER_BASE))]
    vocab = {token: i for i, token in enumerate(TOKENIZER_BASE + tuple(fillers))}
    characters = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    characters.pre_tokenizer = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex(r"[\s\S]"), behavior="isolated"
    )
    characters.decoder = tokenizers.decoders.Fuse()  # characters joined without spaces
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=characters, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun")
THINGS = ("apples", "marbles", "stickers", "pencils", "shells", "coins", "books", "stamps")


def word_problems(n: int, seed: int) -> list[dict]:
    """n GSM8K-format rows (question, answer ending in "#### <number>"): sums, differences,
    products."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        kind = rng.randrange(3)
        if kind == 0:
            question = f"{name} has {a} {thing} and gets {b} more. How many {thing} now?"
            answer = f"{name} has {a} + {b} = {a + b} {thing}.\n#### {a + b}"
        elif kind == 1:
            a, b = max(a, b), min(a, b)
            question = f"{name} had {a} {thing} and gave away {b}. How many {thing} are left?"
            answer = f"{a} - {b} = {a - b} are left.\n#### {a - b}"
        else:
            a = a % 12 + 2
            question = f"{name} fills {a} bags with {b} {thing} each. How many {thing} is that?"
            answer = f"{a} * {b} = {a * b} {thing}.\n#### {a * b}"
        rows.append({"question": question, "answer": answer})
    return rows


def random_tensors(model: moe.MoETransformer, seed: int):
    """(name, tensor) for a meta-device model's parameters, each made when asked: norms ones,
    matrices N(0, 0.02) in BF16 (Hugging Face's init), from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    for name, meta in model_tensors(model):
        tensor = torch.empty(meta.shape, dtype=torch.bfloat16)
        if tensor.dim() == 1:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)
        yield name, tensor


def random_checkpoint(
    out: str,
    n_layers: int,
    shape: str = "",
    seed: int = 0,
    task_rows: int = 256,
    overwrite: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> str:
    """Write a random-weight Qwen3-MoE checkpoint of n_layers at Qwen3-30B-A3B's shapes (or as
    `shape` replaces them), its tokenizer and out/gsm8k.jsonl -> out."""
    runs.require(runs.is_int(n_layers) and n_layers >= 1, "random-layers", n_layers, "must be >= 1")
    runs.require(
        runs.is_int(task_rows) and task_rows >= 100,
        "task-rows",
        task_rows,
        "must be an integer >= 100 (about a tenth are held out for evaluation)",
    )
    overrides = shape_overrides(shape)
    config = moe.MoEConfig.from_preset("qwen3-30b-a3b", n_layers=n_layers, **overrides)
    check_out(out, overwrite, [])
    with torch.device("meta"):
        model = moe.MoETransformer(config)

    def fill(directory):
        tokenizer = char_tokenizer(config.vocab_size)
        tokenizer.save_pretrained(directory)
        token_ids = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": None}
        hub = hub_config(config, torch.bfloat16, token_ids)
        runs.write_text(json.dumps(hub, indent=2), os.path.join(directory, "config.json"))
        write_safetensors(random_tensors(model, seed), directory, torch.bfloat16, max_shard_bytes)
        lines = [json.dumps(row) + "\n" for row in word_problems(task_rows, seed)]
        runs.write_text("".join(lines), os.path.join(directory, "gsm8k.jsonl"))

    write_directory(out, fill)
    print(
        f"wrote a random Qwen3-MoE of {model.num_params() / 1e9:.2f}B parameters "
        f"({n_layers} layers) to {out}; train on it with\n"
        f"  python train.py --model {out} --task gsm8k --task-source "
        f"{os.path.join(out, 'gsm8k.jsonl')}"
    )
    return out


# ----------------------------------------------------------------------------- command line
def main(argv=None):
    """The command line. A ConfigError exits 2 with its one line."""
    parser = runs.Parser(
        prog="python -m tools.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "run",
        metavar="RUN",
        nargs="?",
        help="a run directory (its checkpoint.pt) or checkpoint file",
    )
    parser.add_argument(
        "--out", default="", help="the checkpoint's directory (default: RUN/export_step<N>)"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        help="float32 (the master weights) or bfloat16 (half the bytes)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a directory that is there"
    )
    parser.add_argument(
        "--random-layers",
        type=int,
        metavar="N",
        help="instead of a run: random weights, N layers of Qwen3-30B-A3B's shapes (needs --out)",
    )
    parser.add_argument(
        "--shape",
        default="",
        help="with --random-layers: fields replaced, e.g. dim=256,n_experts=16",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="with --random-layers: the weights' seed"
    )
    parser.add_argument(
        "--task-rows", type=int, default=256, help="with --random-layers: rows of gsm8k.jsonl"
    )
    args = parser.parse_args(argv)
    try:
        random_flags = args.shape or args.seed != 0 or args.task_rows != 256
        runs.refuse(
            random_flags and args.random_layers is None,
            "shape",
            "--shape, --seed and --task-rows apply to --random-layers only",
        )
        if args.random_layers is None:
            refuse_run(not args.run, "give a run directory, or --random-layers N --out DIR")
            return export_run(args.run, args.out, args.dtype, args.overwrite)
        runs.refuse(bool(args.run), "random-layers", "writes random weights: give no RUN")
        runs.refuse(not args.out, "out", "--random-layers needs the directory to write: --out DIR")
        runs.refuse(args.dtype != "float32", "dtype", "a random checkpoint is written in bfloat16")
        return random_checkpoint(
            args.out, args.random_layers, args.shape, args.seed, args.task_rows, args.overwrite
        )
    except runs.ConfigError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
