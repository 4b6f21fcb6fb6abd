"""The recipe comparison: several variants of one run from one warm-start and seed, with a shared
figure and table.

    python -m tools.compare bf16,nvfp4,quads                       # the paper's experiment
    python -m tools.compare rac@0,rac@0.25,rac@0.5,nvfp4+tis2,quads+r3   # RAC ratio, TIS, R3
    python -m tools.compare bf16,fp8,nvfp4,quads --jobs 4          # four processes sharing one GPU

A variant is recipe[@rac_ratio][+tisC][+r3]; every other option is train.py's and applies to all of
them, except --recipe, which the variants set (refused here), and --rac-ratio and --rac-refresh,
which apply to the variants with RAC (refused when none has it). Each variant is a train.py run in
out_dir/<variant>/ (named as written: `rac@0.5` keeps its ratio); the figure and table go to
out_dir/compare_<variants>.png and .md. Nothing is replaced unasked: runs and outputs that exist are
refused unless --resume continues them or --overwrite starts them over.
"""

import copy
import dataclasses
import hashlib
import math
import multiprocessing
import os
import sys

# also as a plain script
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tools import runs  # noqa: E402
import train  # noqa: E402
from tools.plot import plot, summarize  # noqa: E402

FORM = "the form is recipe[@rac_ratio][+tisC][+r3], e.g. bf16,nvfp4,quads@0.25+tis2"


def parse_variant(spec):
    """A variant "recipe[@rac_ratio][+tisC][+r3]" (e.g. "quads@0.25", "nvfp4+tis2+r3") -> the
    TrainConfig fields it sets. Fields it leaves out keep the command line's values."""
    head, *flags = spec.split("+")
    recipe, at, ratio = head.partition("@")
    if not recipe:
        raise runs.ConfigError(f"argument variants: variant {spec!r} names no recipe; {FORM}")
    if recipe not in train.RECIPES:
        raise runs.ConfigError(
            f"argument variants: unknown recipe {recipe!r} in variant {spec!r}; choose "
            f"from {', '.join(train.RECIPES)}"
        )
    fields = {"recipe": recipe}
    try:
        if at:
            fields["rac_ratio"] = float(ratio)
        for flag in flags:
            if flag == "r3":
                fields["r3"] = True
            elif flag.startswith("tis"):
                fields["tis"] = float(flag[3:])
            else:
                raise ValueError(flag)
    except ValueError:
        raise runs.ConfigError(f"argument variants: cannot read variant {spec!r}; {FORM}") from None
    if at and not train.RECIPES[recipe][2]:
        rac_recipes = ", ".join(r for r in train.RECIPES if train.RECIPES[r][2])
        raise runs.ConfigError(
            f"argument variants: variant {spec!r}: recipe {recipe} has no RAC, so no "
            f"@ratio; RAC recipes: {rac_recipes}"
        )
    if not 0 <= fields.get("rac_ratio", 0) <= 1:
        raise runs.ConfigError(
            f"argument variants: variant {spec!r}: the RAC ratio after '@' must be in [0, 1]"
        )
    if not 0 <= fields.get("tis", 0) < math.inf:
        raise runs.ConfigError(
            f"argument variants: variant {spec!r}: the TIS cap after 'tis' must be >= 0"
        )
    return fields


RAC_FIELDS = ("rac_ratio", "rac_refresh")  # what only a recipe with RAC uses


def variant_configs(cfg, variants):
    """ "v1,v2,..." -> one TrainConfig per variant, named as written (a given @ratio stays in the
    name). A recipe without RAC gets the RAC fields' defaults: it has nothing they apply to."""
    specs = variants.split(",")
    if not all(specs):
        raise runs.ConfigError(
            f"argument variants: empty variant in {variants!r}; give comma-separated "
            "variants, e.g. bf16,nvfp4,quads"
        )
    configs = []
    for spec in specs:
        fields = parse_variant(spec)
        if not train.RECIPES[fields["recipe"]][2]:
            fields.update({name: getattr(train.TrainConfig, name) for name in RAC_FIELDS})
        config = dataclasses.replace(cfg, run_name="", **fields)
        config.run_name = train.variant_name(config, ratio_given="rac_ratio" in fields)
        configs.append(config)
    for i, config in enumerate(configs):
        unnamed = dataclasses.replace(config, run_name="")
        earlier = [c for c in configs[:i] if dataclasses.replace(c, run_name="") == unnamed]
        same = earlier[0] if earlier else None
        if same is not None and same.run_name == config.run_name:
            raise runs.ConfigError(
                f"argument variants: {variants!r} names the run {config.run_name!r} twice"
            )
        if same is not None:
            raise runs.ConfigError(
                f"argument variants: {same.run_name!r} and {config.run_name!r} are the "
                "same run; give it once"
            )
    return configs


def compare_paths(cfg, run_names):
    """The figure and table, named by the variants (so that another comparison keeps its own)."""
    stem = "compare_" + "_".join(run_names)
    if len(stem) > 100:  # file names have a length limit
        digest = hashlib.sha1(",".join(run_names).encode()).hexdigest()[:10]
        stem = f"compare_{len(run_names)}variants_{digest}"
    return os.path.join(cfg.out_dir, stem + ".png"), os.path.join(cfg.out_dir, stem + ".md")


def study(cfg, variants, jobs=1):
    """Every variant from one warm-start (computed once) and seed; shared figure and table. -> run
    dirs"""
    configs = variant_configs(cfg, variants)
    outputs = compare_paths(cfg, [c.run_name for c in configs])
    for config in configs:  # refuse before the warm-start writes anything
        runs.check_run_dir(config, rename="choose another --out-dir")
    existing = [path for path in outputs if os.path.exists(path)]
    if existing and not (cfg.resume or cfg.overwrite):
        raise runs.ConfigError(
            f"{existing[0]} exists: add --overwrite to replace it (or --resume to "
            "continue the runs)"
        )
    task = train.build_task(configs[0])
    model, tokenizer = train.build_model(configs[0], task)
    base_state = copy.deepcopy(train.warmstart(configs[0], model, task, tokenizer).state_dict())
    if jobs == 1:
        run_dirs = [train.run(config, base_state) for config in configs]
    else:
        # Each process loads the warm-start from its cache, written above. Timings (rollout tok/s,
        # step s) are then measured on a shared device: compare them only between runs made with
        # the same --jobs.
        del model, base_state
        threads = max(1, torch.get_num_threads() // jobs)  # CPU: split the cores between processes
        with multiprocessing.get_context("spawn").Pool(
            jobs, torch.set_num_threads, (threads,)
        ) as pool:
            run_dirs = pool.map(train.run, configs, chunksize=1)
    figure, table_path = outputs
    plot(run_dirs, figure)
    table = summarize(run_dirs)
    runs.write_text(table + "\n", table_path)
    print(f"{table}\ntable: {table_path}")
    return run_dirs


def main(argv=None):
    """The command line: train.py's options, the variants and --jobs. A ConfigError exits 2 with one
    line."""
    parser = train.build_parser(
        prog="python -m tools.compare",
        description=__doc__,
        usage="python -m tools.compare V1,V2,... [--jobs N] [train.py options]",
    )
    parser.add_argument("variants", help="comma-separated variants recipe[@rac_ratio][+tisC][+r3]")
    # None tells a --recipe given from none: the variants set the recipe, so one given is refused
    parser.set_defaults(recipe=None)
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="variants run at once, one process "
        "each (a small model leaves a GPU mostly idle) (default: 1)",
    )
    args = vars(parser.parse_args(argv))
    variants = args.pop("variants")
    jobs = args.pop("jobs")
    recipe = args.pop("recipe")
    try:
        runs.require(runs.is_int(jobs) and jobs >= 1, "jobs", jobs, "must be an integer >= 1")
        runs.refuse(
            recipe is not None,
            "recipe",
            f"not allowed with a comparison: its variants name the recipes (e.g. {recipe},bf16)",
        )
        # (an empty variant is refused by variant_configs, with the others' problems)
        recipes = [parse_variant(spec)["recipe"] for spec in variants.split(",") if spec]
        any_rac = any(train.RECIPES[name][2] for name in recipes)
        for name in RAC_FIELDS:
            runs.refuse(
                args[name] != getattr(train.TrainConfig, name) and not any_rac,
                name,
                f"no variant of {variants!r} has RAC, so the value would change nothing",
            )
        runs.refuse(
            args["run_name"],
            "run-name",
            "not allowed with a comparison (it names each variant's directory itself)",
        )
        runs.refuse(
            "RANK" in os.environ,
            "variants",
            "not allowed under torchrun (a comparison runs processes of its own)",
        )
        cfg = train.TrainConfig(**args)
        runs.set_threads(cfg)
        return study(cfg, variants, jobs)
    except runs.ConfigError as error:
        parser.error(str(error))
    except KeyboardInterrupt:
        runs.interrupted_before_rl()


if __name__ == "__main__":
    main()
