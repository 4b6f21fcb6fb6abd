"""A run's directory: what makes a run durable and never destroyed unasked.

A run lives in out_dir/run_name/: config.json (the config, and one provenance entry per start:
commit, versions, device), metrics.jsonl (one JSON line per step; step 0 holds the warm-started
policy's pass@k), samples.jsonl (a few evaluation completions with their rewards, every
evaluation) and checkpoint.pt (step, trainer and optimizer state, config). The starting policies
are cached in one directory shared by every out_dir (--warmstart-dir, default runs/warmstart: beside
the default runs, so that the caches made before the flag existed are found where they are), keyed
by what determines them (warmstart_path). The rules:
- a directory holding a run is refused unless --resume continues it (the checkpoint's stored config
  must match, except RESUMABLE_FIELDS: --steps may grow) or --overwrite starts it over
  (check_run_dir, before anything is written; a directory that cannot be made is refused there too);
- every file is written atomically (atomic_save): a crash never leaves half a checkpoint;
- Ctrl-C while a step changes the weights is held until that step is logged and saved
  (HeldInterrupt), so a checkpoint is always of a whole step, and a resumed run repeats the same
  data order and seeds;
- what cannot run is one line (ConfigError: the CLI prints it and exits 2), never a traceback;
- the command line is built from the config dataclass (build_parser): a field's comment is its
  --help; every value is checked before anything runs (validate), each problem one line naming its
  flag; a flag must be spelt out (no abbreviations), and a misspelt one gets the nearest names.
"""

import argparse
import dataclasses
import difflib
import hashlib
import inspect
import json
import math
import os
import pickle
import re
import platform
import signal
import subprocess
import sys
import tempfile
import typing

import torch

import moe


class ConfigError(ValueError):
    """A run that cannot start as asked: one line for the user (the CLI prints it and exits 2)."""


# ----------------------------------------------------------------------------- the config's values
# "org/name"; anything else must be a local directory
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
AT_LEAST = dict(
    steps=1,
    prompts_per_step=1,
    max_new_tokens=1,
    warmstart_batch=1,
    eval_every=1,
    eval_prompts=1,
    checkpoint_every=1,
    rac_refresh=1,
    threads=1,
    difficulty=1,
    minibatches=1,
    eval_samples=1,
    group_size=2,
    seed=0,
    warmstart_steps=0,
)
BOUNDED = dict(
    rac_ratio=(lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    demo_error_rate=(lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    clip_low=(lambda v: 0 <= v < 1, "must be in [0, 1)"),
    clip_high=(lambda v: 0 <= v < math.inf, "must be a number >= 0"),
    tis=(lambda v: 0 <= v < math.inf, "must be a number >= 0 (0 = off)"),
    clip_ratio_c=(lambda v: v == 0 or 1 < v < math.inf, "must be 0 (off) or a number > 1"),
    kl_coef=(lambda v: 0 <= v < math.inf, "must be a number >= 0 (0 = off)"),
    **{
        name: (lambda v: 0 < v < math.inf, "must be a number > 0")
        for name in ("lr", "warmstart_lr", "grad_clip", "temperature")
    },
)


def validate(cfg, choices):
    """Every value as given, before the defaults fill in the rest: a ConfigError naming the flag."""
    for name, low in AT_LEAST.items():
        value, why = (
            getattr(cfg, name),
            " (GRPO compares the samples of one prompt)" * (name == "group_size"),
        )
        require(
            value is None or is_int(value) and value >= low,
            name,
            value,
            f"must be an integer >= {low}{why}",
        )
    for name, (ok, allowed) in BOUNDED.items():
        value = getattr(cfg, name)
        require(
            value is None and name in ("lr", "warmstart_lr") or is_real(value) and ok(value),
            name,
            value,
            allowed,
        )
    for name, allowed_values in choices.items():
        value = getattr(cfg, name)
        require(
            value is None or value in allowed_values,
            name,
            value,
            f"choose from {', '.join(allowed_values)}",
        )
    kind, _, index = (cfg.device or "cpu").partition(":")
    require(
        kind in ("cpu", "cuda") and (not index or kind == "cuda" and index.isdigit()),
        "device",
        cfg.device,
        "choose from cpu, cuda, cuda:N",
    )
    refuse(
        kind == "cuda" and not torch.cuda.is_available(),
        "device",
        f"{cfg.device!r} but torch {torch.__version__} sees no CUDA GPU (built with CUDA "
        f"{torch.version.cuda}); use --device cpu",
    )
    refuse(
        index and int(index) >= torch.cuda.device_count(),
        "device",
        f"{cfg.device!r} but there are {torch.cuda.device_count()} GPUs",
    )
    refuse(
        cfg.preset and cfg.model, "preset", "not allowed with argument --model (it has its size)"
    )
    refuse(
        cfg.preset_overrides and cfg.model,
        "preset-overrides",
        "not allowed with argument --model (it has its size)",
    )
    refuse(
        cfg.model and cfg.task == "arith",
        "model",
        "a real checkpoint brings its own tokenizer: add --task gsm8k",
    )
    refuse(
        not cfg.model and cfg.task != "arith",
        "task",
        f"{cfg.task} needs a real model and its tokenizer: add --model DIR",
    )
    refuse(cfg.task_source and cfg.task == "arith", "task-source", "applies to --task gsm8k only")
    refuse(
        cfg.difficulty is not None and cfg.task != "arith",
        "difficulty",
        "applies to --task arith only",
    )
    refuse(
        cfg.model and not os.path.isdir(cfg.model) and not HUB_ID.fullmatch(cfg.model),
        "model",
        f"no such directory: {cfg.model} (give a Hugging Face Qwen3-MoE directory, or a hub id "
        "such as Qwen/Qwen3-30B-A3B)",
    )
    require(
        cfg.run_name == ""
        or os.path.basename(cfg.run_name) == cfg.run_name
        and cfg.run_name not in (".", "..", "warmstart"),
        "run-name",
        cfg.run_name,
        "must be a directory name under --out-dir (no '/'; 'warmstart' holds the warm-start cache)",
    )
    require(cfg.warmstart_dir, "warmstart-dir", cfg.warmstart_dir, "must name a directory")
    refuse(cfg.resume and cfg.overwrite, "overwrite", "not allowed with argument --resume")
    refuse(
        cfg.fsdp and "RANK" not in os.environ,
        "fsdp",
        "shards the trainer across torchrun ranks: run it "
        "as torchrun --nproc_per_node=N train.py --fsdp ...",
    )
    refuse(
        cfg.mipu and cfg.fsdp,
        "mipu",
        "not allowed with argument --fsdp (a rejected update restores whole state dicts)",
    )
    refuse(
        cfg.mipu and cfg.tis,
        "mipu",
        "not allowed with argument --tis (MIPU takes its ratios against the "
        "rollout's own log-probs, so there is no engine mismatch left for TIS to correct)",
    )


def preset_overrides(preset, text):
    """--preset-overrides "dim=128,expert_dim=128" -> the moe.MoEConfig fields it replaces in the
    preset, checked: known fields, values of their type, a config moe.py accepts, and NVFP4's
    16-element blocks dividing every reduction dimension the rollout quantizes (dim, n_heads x
    head_dim, expert_dim)."""
    if not text:
        return {}
    types = {
        f.name: f.type for f in dataclasses.fields(moe.MoEConfig) if f.name != "vocab_size"
    }  # the task's
    words, overrides = {int: "an integer", float: "a number", bool: "true or false"}, {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        require(
            name in types,
            "preset_overrides",
            text,
            f"{name!r} is not a model field; give name=value "
            f"pairs joined by commas, names from {', '.join(types)}",
        )
        kind = types[name]
        try:
            overrides[name] = {"true": True, "false": False}[value] if kind is bool else kind(value)
        except (KeyError, ValueError):
            raise ConfigError(
                f"argument --preset-overrides: {name}={value!r} must be {words[kind]}"
            ) from None
    try:
        config = moe.MoEConfig.from_preset(preset, **overrides)
    except ValueError as error:
        raise ConfigError(f"argument --preset-overrides: {error}") from None
    widths = {
        "dim": config.dim,
        "n_heads x head_dim": config.n_heads * config.head_dim,
        "expert_dim": config.expert_dim,
    }
    for name, width in widths.items():
        require(
            width % 16 == 0,
            "preset_overrides",
            text,
            f"{name} = {width} must be a multiple of 16 "
            "(NVFP4 quantizes 16-element blocks along it)",
        )
    return overrides


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def require(ok, name, value, allowed):
    if not ok:
        raise ConfigError(f"argument --{name.replace('_', '-')}: {allowed}, got {value!r}")


def refuse(bad, name, why):
    if bad:
        raise ConfigError(f"argument --{name.replace('_', '-')}: {why}")


def one_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


# ----------------------------------------------------------------------------- the warm-start cache
WARMSTART_KEY = (
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
)  # what determines it; not the recipe


def warmstart_path(cfg):
    """warmstart_dir/<hash of WARMSTART_KEY's values>.pt, every recipe's starting policy, whatever
    the out_dir. Preset overrides join the key only when given, so the keys of runs without them are
    those of before the option. A cache made before --warmstart-dir existed, in out_dir/warmstart/,
    is still used when the shared directory has none of that key."""
    fields = WARMSTART_KEY + ("preset_overrides",) * bool(cfg.preset_overrides)
    key = json.dumps({name: getattr(cfg, name) for name in fields}, sort_keys=True)
    name = hashlib.sha1(key.encode()).hexdigest()[:12] + ".pt"
    shared = os.path.join(cfg.warmstart_dir, name)
    earlier = os.path.join(cfg.out_dir, "warmstart", name)
    if not os.path.exists(shared) and os.path.exists(earlier):
        return earlier
    return shared


def check_writable_dir(path, flag):
    """Refuse, in one line and before anything is written, a directory that cannot be made or
    written into: a file on its path (README.md, /dev/null/x) or a parent that takes no new entry
    (/proc/x). The probe is a temporary directory made and removed in the nearest existing
    ancestor."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(
            f"argument --{flag}: cannot make {path}: {existing} is not a directory; give a "
            "directory"
        )
    try:
        probe = tempfile.mkdtemp(prefix=".write_check_", dir=existing)
    except OSError as error:
        raise ConfigError(
            f"argument --{flag}: cannot make {path}: {existing} takes no new entry "
            f"({error.strerror}); give a writable directory"
        ) from None
    os.rmdir(probe)


CHECKPOINT_KEYS = {"step", "trainer", "optimizer", "config"}


def load_checkpoint(path, device, fix, what="checkpoint"):
    """torch.load, with a file that cannot be read (truncated, not torch's format, not a train.py
    checkpoint) as one ConfigError."""
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as error:
        raise ConfigError(f"cannot read the {what} {path} ({one_line(error)}): {fix}") from None
    if what == "checkpoint" and not (isinstance(ckpt, dict) and CHECKPOINT_KEYS <= set(ckpt)):
        raise ConfigError(f"cannot read the checkpoint {path}: not a train.py checkpoint; {fix}")
    return ckpt


def atomic_save(obj, path, write=torch.save):
    """Write to a temporary file, then rename: a crash never leaves a half-written file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    write(obj, tmp)
    os.replace(tmp, path)


def write_text(text, path):
    with open(path, "w") as f:
        f.write(text)


def read_metrics(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


RUN_FILES = ("metrics.jsonl", "checkpoint.pt")  # what makes a directory hold a run
# what a resumed run may change: when it stops and what it writes, not what it computes
RESUMABLE_FIELDS = {
    "steps",
    "eval_every",
    "checkpoint_every",
    "resume",
    "overwrite",
    "out_dir",
    "run_name",
    "threads",
    "cuda_graph",
    "fsdp",
    "warmstart_dir",
    "log_to",
    "eval_samples",  # evaluation only; and absent from the checkpoints of before it
    "eval_trainer",  # evaluation only
}


def check_run_dir(cfg, rename="choose another --run-name"):
    """Refuse, before anything is written, to start where a run would be destroyed; under --resume
    read the checkpoint and check that it continues this run. -> the checkpoint to resume from, or
    None."""
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    ckpt_path = os.path.join(run_dir, "checkpoint.pt")
    check_writable_dir(cfg.out_dir, "out-dir")
    check_writable_dir(cfg.warmstart_dir, "warmstart-dir")
    if not cfg.resume:
        found = [name for name in RUN_FILES if os.path.exists(os.path.join(run_dir, name))]
        if found and not cfg.overwrite:
            raise ConfigError(
                f"{run_dir} holds a run ({', '.join(found)}): add --resume to continue it, "
                f"--overwrite to start it over, or {rename}"
            )
        return None
    if not os.path.exists(ckpt_path):
        raise ConfigError(
            f"argument --resume: no checkpoint {ckpt_path} to resume (drop --resume to start "
            "the run, or give the --out-dir and --run-name of the run to continue)"
        )
    ckpt = load_checkpoint(
        ckpt_path, cfg.device, "restore it, or start the run over with --overwrite"
    )
    stored = {f.name: ckpt["config"].get(f.name, f.default) for f in dataclasses.fields(cfg)}
    changes = [
        f"--{name.replace('_', '-')} {value} -> {getattr(cfg, name)}"
        for name, value in stored.items()
        if name not in RESUMABLE_FIELDS and value != getattr(cfg, name)
    ]
    if changes:
        raise ConfigError(
            f"cannot resume {run_dir}: this command changes {', '.join(changes)}; a resumed "
            "run keeps its config (--steps may grow): give the run's values, or a new "
            "--run-name"
        )
    if cfg.steps < ckpt["step"]:
        raise ConfigError(
            f"argument --steps: {cfg.steps}, but the run in {run_dir} is at step "
            f"{ckpt['step']}; "
            f"a run cannot be shortened (give --steps >= {ckpt['step']})"
        )
    return ckpt


class HeldInterrupt:
    """Ctrl-C while a step changes the trainer's weights (from its first optimizer step to its
    metrics line and checkpoint) is held until that step ends, so that what is saved is always a
    finished, logged step; elsewhere, and on a second Ctrl-C, it acts at once. Only in the main
    thread (signals live there)."""

    def __init__(self, step):
        self.step = step  # the RL loop's step: finished steps, or the one whose update is running
        self.holding = self.requested = False
        self.previous = None

    def __enter__(self):
        try:
            self.previous = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread: Ctrl-C keeps its default meaning
            self.previous = None
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def _handler(self, signum, frame):
        if self.holding and not self.requested:
            self.requested = True
            # a line of its own, below the progress bar's
            print(
                "\nCtrl-C: finishing this step's update, then saving (Ctrl-C again: stop now, "
                "unsaved)",
                file=sys.stderr,
                flush=True,
            )
            return
        raise KeyboardInterrupt

    @staticmethod
    def stop(message, ranks):
        if ranks.main:
            print(message, file=sys.stderr)
        sys.exit(130)


def report(cfg, run_dir, warmstart, start_step=None):
    """The end-of-run summary: the RL steps' own time (this command's steps: not the warm-start, not
    what ran before a resume), final pass@k, mismatch over the run, the last evaluation's first
    sample, and where everything is."""
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    steps, evals = [r for r in records if r["step"] > 0], [r for r in records if "pass@1" in r]
    lines = [f"{cfg.run_name}: {steps[-1]['step'] if steps else 0} steps"]
    ran = [r for r in steps if start_step is not None and r["step"] > start_step]
    if ran:
        resumed = f" (resumed at step {start_step})" if start_step else ""
        seconds = sum(r["step_s"] for r in ran)
        lines[0] += f"; RL steps {ran[0]['step']}-{ran[-1]['step']} took {seconds:.0f} s{resumed}"
    if evals:
        first, last = evals[0], evals[-1]
        now = f"rollout {last['pass@1']:.3f}"
        then = f"{first['pass@1']:.3f}"
        if "pass@1_bf16_trainer" in last:  # absent under --no-eval-trainer
            now += f", BF16 trainer {last['pass@1_bf16_trainer']:.3f}"
            then += f", {first['pass@1_bf16_trainer']:.3f}"
        lines.append(f"  pass@1        {now} at step {last['step']} (step {first['step']}: {then})")
        more = [key for key in pass_at_k_keys(last) if key != "pass@1"]
        if more:
            values = ", ".join(f"{key} {last[key]:.3f}" for key in more)
            lines.append(f"  pass@k        rollout {values} at step {last['step']}")
    if steps:
        mean = sum(r["mismatch/abs_diff_mean"] for r in steps) / len(steps)
        worst = max(r["mismatch/abs_diff_max"] for r in steps)
        lines.append(
            f"  |delta logp|  mean {mean:.2e}, max {worst:.3f} over steps 1-{steps[-1]['step']}"
        )
    samples_path = os.path.join(run_dir, "samples.jsonl")
    samples = read_metrics(samples_path)
    if samples:
        last_step = samples[-1]["step"]
        sample = next(r for r in samples if r["step"] == last_step)
        lines.append(
            f"  sample        step {last_step}, reward {sample['reward']:g}: "
            f"{sample['prompt']!r} -> {sample['completion']!r}"
        )
    lines += [
        f"  {'metrics':<13} {os.path.join(run_dir, 'metrics.jsonl')}",
        f"  {'samples':<13} {samples_path}" if samples else None,
        f"  {'checkpoint':<13} {os.path.join(run_dir, 'checkpoint.pt')}",
        f"  {'warm-start':<13} {warmstart}",
        f"  {'figure':<13} python -m tools.plot {run_dir}",
    ]
    return "\n".join(line for line in lines if line is not None)


def pass_at_k_keys(record, suffix=""):
    """The pass@k keys of a metrics record in the order of k: pass@1, pass@2, pass@4, ..."""
    found = []
    for key in record:
        match = re.fullmatch(r"pass@(\d+)" + re.escape(suffix), key)
        if match:
            found.append((int(match.group(1)), key))
    return [key for _, key in sorted(found)]


class Parser(argparse.ArgumentParser):
    """argparse with every flag spelt out (an abbreviation such as --step for --steps is refused,
    not guessed), a misspelt flag answered with the nearest names, and an error as one line."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(self.unknown_message(unknown))
        return parsed

    def unknown_message(self, unknown):
        """'unrecognized argument --step: did you mean --steps?' for the first unknown flag."""
        flags = [word for word in unknown if word.startswith("--")]
        if not flags:
            return f"unrecognized arguments: {' '.join(unknown)}"
        flag = flags[0].partition("=")[0]
        known = [name for name in self._option_string_actions if name.startswith("--")]
        nearest = [name for name in known if name.startswith(flag)]
        if not nearest:
            # the closest spellings, and only those about as close as the closest
            similarity = {name: difflib.SequenceMatcher(None, flag, name).ratio() for name in known}
            best = max(similarity.values(), default=0.0)
            nearest = sorted(
                (name for name in known if similarity[name] >= max(0.7, best - 0.1)),
                key=lambda name: -similarity[name],
            )
        if not nearest:
            return f"unrecognized argument {flag} (see --help)"
        if len(nearest) == 1:
            return f"unrecognized argument {flag}: did you mean {nearest[0]}?"
        listed = ", ".join(nearest[:3][:-1]) + " or " + nearest[:3][-1]
        return f"unrecognized argument {flag}: did you mean {listed}?"

    def error(self, message):
        # argparse's "prog: error: ..." and exit 2, without the 40-option usage
        self.exit(2, f"{self.prog}: error: {message}\n")


def option_docs(config_class):
    """A config dataclass's source -> {field: (group, help)}: a field's trailing comment is its
    help, a comment line of its own opens a group. The dataclass stays the one place where an option
    is documented."""
    docs, group = {}, "options"
    for line in inspect.getsource(config_class).splitlines()[1:]:
        if line.startswith("    def "):
            break
        title, more = re.fullmatch(r"    # (.+)", line), re.fullmatch(r"     +# (.+)", line)
        field = re.fullmatch(r"    (\w+): [^#]*?(?:#\s*(.*))?", line)
        if title:
            group = title.group(1)
        elif field:
            name = field.group(1)
            docs[name] = (group, field.group(2) or "")
        elif more:  # a help text continued on the next line
            docs[name] = (group, f"{docs[name][1]} {more.group(1)}")
    return docs


def build_parser(config_class, choices, prog, usage, description):
    """The command line of a config dataclass: one option per field, grouped and documented as the
    fields are (option_docs), with its type, default and, for the fields in `choices`, the values it
    takes."""
    parser = Parser(
        prog=prog,
        description=description,
        usage=usage,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    docs, groups, hints = option_docs(config_class), {}, typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        group_name, text = docs.get(field.name, ("options", ""))
        group = (
            groups.setdefault(group_name, parser.add_argument_group(group_name))
            if group_name not in groups
            else groups[group_name]
        )
        text += f" {{{', '.join(choices[field.name])}}}" if field.name in choices else ""
        text += f" (default: {field.default})" if field.default not in (None, "") else ""
        kind = hints[field.name]
        kind = next(
            (t for t in typing.get_args(kind) if t is not type(None)), kind
        )  # int | None -> int
        flag, text = "--" + field.name.replace("_", "-"), text.replace("%", "%%")
        if kind is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=field.default, help=text
            )
        else:
            group.add_argument(
                flag,
                type=kind,
                default=field.default,
                help=text,
                metavar={int: "N", float: "X"}.get(kind, "STR"),
            )
    return parser


def provenance(device):
    """Where a run's numbers come from, for its config.json: the commit and whether the tree had
    uncommitted changes to tracked files (None outside a git checkout), the versions of Python,
    torch and Triton, and the device (the GPU's name, or the CPU's architecture and thread
    count)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args):
        try:
            done = subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.SubprocessError):
            return None
        if done.returncode != 0:
            return None
        return done.stdout.strip()

    commit = git("rev-parse", "HEAD")
    changes = git("status", "--porcelain", "--untracked-files=no")
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    return {
        "commit": commit,
        "dirty": None if changes is None else bool(changes),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "device": name,
    }


def read_provenance(config_path):
    """The provenance entries of an earlier config.json (a resumed run keeps them and adds its
    own)."""
    if not os.path.exists(config_path):
        return []
    with open(config_path) as f:
        return json.load(f).get("provenance", [])


def set_threads(cfg):
    """CPU: torch's threads (--threads, or 1 on the tiny preset, whose matmuls gain nothing from a
    second thread, which stalls whenever another process holds a core: several times slower on 2
    shared cores)."""
    threads = cfg.threads or (1 if cfg.preset == "tiny" else None)
    if cfg.device == "cpu" and threads:
        torch.set_num_threads(threads)


def interrupted_before_rl():
    """Ctrl-C before the RL loop (warm-start, loading, the step-0 evaluation): one line of its own
    (below the warm-start's progress bar), exit 130."""
    print(
        "\ninterrupted before the first RL step: no checkpoint written, and the warm-start is "
        "cached only once complete; run the command again to start",
        file=sys.stderr,
    )
    sys.exit(130)
