"""Rebuild the tables and the figures of RESULTS.md from the study folders beside this script.

    python results/study_tables.py          # from the repository root; CPU, about ten seconds

The study folders, each with a README.md that gives the command, the commits and the machines:

    cpu_replication_600steps  12 recipes x 8 seeds, tiny preset, lr 3e-4, 600 steps: one folder
                              per run (config.json, metrics.jsonl gzipped); two outlier reports
    cpu_width_sweep           bf16, nvfp4 and quads on the tiny preset widened to 128 and 256, and
                              short probes of other shapes, one folder per run
    h200_audit                the log-prob audit and the outlier report of one small-preset
                              checkpoint on the H200, as tools.audit wrote them
    gpu_small_600steps        bf16, nvfp4 and quads on the small preset on a GPU, seeds 0-3, 600
                              steps: its tables print once the folder exists, "not run" before

Statistics. A seed fixes the warm-start, the prompts and the sampling noise, so two recipes are
compared by their per-seed differences d_1..d_n on the seeds both ran. A table gives the mean
difference with its 95% Student-t interval

    mean(d) +- t(0.975, n - 1) * s(d) / sqrt(n),        s(d) the sample standard deviation (n - 1),

and the number of seeds on which d > 0; per recipe, the median beside the mean. With 3 to 8 seeds a
percentile bootstrap is too narrow (it has no heavier tails for small n; 4 seeds allow only 35
distinct resamples), so none is used. The t quantile is computed here, in closed form for whole
degrees of freedom, so scipy is not needed.

Collapse. A run has collapsed when its late reward (the mean train reward of steps 301-600) is below
COLLAPSE_BELOW = 0.1, fixed before the counts were read. The tables count collapsed seeds per
recipe: the paper's phenomenon is a collapse, and one collapsed seed moves an 8-seed mean as much as
a recipe.

Provenance. train.py writes into each run's config.json a "provenance" list, one entry per start or
resume (commit, uncommitted changes, Python, torch, Triton, device). Every table prints the
provenance of its runs: the recorded entries, or for runs made before they were recorded what the
results log and the study's README establish (KNOWN_PROVENANCE). A table whose runs span several
commits must say in its caption why it may mix them; without that the script stops with one line.

Left out: BCa and other bootstrap intervals, corrections for the number of comparisons (each
interval stands alone), and the uncertainty of a ratio's denominator (a share of naive NVFP4's loss
divides by the mean loss, taken as exact). It imports nothing from the project, so it runs on any
checkout.
"""

import gzip
import json
import math
import os
import statistics
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
FIGURES = os.path.join(os.path.dirname(HERE), "figures")
REPLICATION = os.path.join(HERE, "cpu_replication_600steps")
WIDTH_SWEEP = os.path.join(HERE, "cpu_width_sweep")
H200_AUDIT = os.path.join(HERE, "h200_audit")
GPU_STUDY = os.path.join(HERE, "gpu_small_600steps")
ORDER = [
    "bf16",
    "fp8",
    "nvfp4",
    "w4a16",
    "w16a4",
    "qat",
    "rac",
    "quads",
    "moeresq",
    "trace",
    "nvfp4+row",
    "quads+row",
]
COMMAND = (
    "python train.py --recipe R [--act-scale row] --steps 600 --lr 3e-4 --eval-prompts 512 --seed S"
)
COLLAPSE_BELOW = 0.1  # a late reward below it is a collapsed run (fixed before counts were read)
INTERVALS = "Intervals: 95% Student-t intervals of the mean paired per-seed difference (n - 1 df)."

# What is known of the runs made before train.py recorded its provenance (their config.json holds
# none): from results/LOG.md, each study folder's README.md, the commits that added the files, and
# reruns of a few runs' first 3 steps on a 2-core CPU with torch 2.13 (python train.py --recipe R
# --steps 3 --lr 3e-4 --eval-prompts 512 --seed S, in a tree of the commit named; every metric but
# the timings compared with the stored run's). Keyed by a path under results/; the longest key that
# starts a file's path applies. Values: (the commits, what is known).
KNOWN_PROVENANCE = {
    "cpu_replication_600steps": (
        ("f233fbb", "8d36956"),
        "commit f233fbb for most runs of seeds 0 and 1, 8d36956 for the rest, fp8's included "
        "(its 8 seeds rerun bit for bit at 8d36956; seed 0 does not at f233fbb); a 2-core x86 CPU "
        "(torch 2.13 CPU build) for seeds 0, 1 and 5-7, every seed of fp8, moeresq and trace, and "
        "bf16 seed 4; the H200 machine's 16 CPU cores (torch 2.11.0+cu130, --device cpu) for the "
        "other runs of seeds 2-4; fp32",
    ),
    "cpu_replication_600steps/outliers_": (
        ("fcdb18b",),
        "tools.audit --outliers at fcdb18b or 22963c1 (which changed only a GPU kernel and tests), "
        "on the 2-core CPU, on the final checkpoints of bf16 and nvfp4 seed 0",
    ),
    "cpu_width_sweep": (
        ("0c80b9c",),
        "commit 0c80b9c; a 2-core x86 CPU, torch 2.13.0 CPU build, fp32",
    ),
    "h200_audit": (
        ("fcdb18b",),
        "commit fcdb18b; one NVIDIA H200, torch 2.11.0+cu130, Triton 3.6.0",
    ),
}

# Why a table may mix the commits it mixes: a table whose runs span several commits names one.
REPLICATION_MIX = (
    "on the CPU the two commits compute the same metrics bit for bit for the recipes checked "
    "(quads+row, w16a4 and trace, 3-4 steps, the folder's README); fp8's CPU path differs between "
    "them, and all its runs are 8d36956's. The two machines differ in the last bits: nvfp4 seed 2, "
    "run on the H200 machine, reruns on the 2-core CPU with the same rewards and losses for 3 "
    "steps and log-prob metrics within 1e-6 relative, so at seeds 2-4 some pairs span machines."
)
WIDTHS_MIX = (
    "width 64 is the replication's runs (f233fbb and 8d36956, the same on the CPU where checked); "
    "widths 128 and 256 ran at 0c80b9c, whose CPU path for these recipes differs from 8d36956's "
    "only in how train.py builds the model (--preset-overrides), and which reruns nvfp4 seed 0 of "
    "the replication bit for bit for 3 steps."
)
SMALL_PRESET_MIX = "the small preset's rows come from the audit's checkpoint at fcdb18b."


# ----------------------------------------------------------------------------- statistics
def t_within(t, df):
    """P(|T| <= t) for Student's t with df degrees of freedom (a whole number >= 1), in closed form
    (Abramowitz and Stegun 26.7.3-4). With theta = atan(t / sqrt(df)) and c = cos(theta)^2:

        df odd:   (2 / pi) * (theta + sin(theta) cos(theta) * sum_{k < (df - 1) / 2} a_k c^k),
                  a_0 = 1, a_k = a_{k-1} * 2k / (2k + 1)
        df even:  sin(theta) * sum_{k < df / 2} b_k c^k,
                  b_0 = 1, b_k = b_{k-1} * (2k - 1) / (2k)
    """
    theta = math.atan(t / math.sqrt(df))
    c = math.cos(theta) ** 2
    odd = df % 2 == 1
    terms = (df - 1) // 2 if odd else df // 2
    term = 1.0
    total = 0.0
    for k in range(terms):
        if k > 0:
            term *= 2 * k / (2 * k + 1) if odd else (2 * k - 1) / (2 * k)
        total += term * c**k
    if odd:
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    return math.sin(theta) * total


def t_quantile(probability, df):
    """The t with P(T <= t) = probability (above 0.5): the root of
    t_within(t, df) = 2 probability - 1, by bisection (t_within rises with t)."""
    if not 0.5 < probability < 1 or df < 1 or df != int(df):
        raise ValueError(
            f"t_quantile: probability={probability}, df={df}; allowed: 0.5 < probability < 1, "
            "df a whole number >= 1"
        )
    target = 2 * probability - 1
    low = 0.0
    high = 1.0
    while t_within(high, df) < target:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        if t_within(middle, df) < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def t_interval(values, level=0.95):
    """The Student-t interval of the mean of `values`:
    mean +- t((1 + level) / 2, n - 1) * s / sqrt(n)."""
    if len(values) < 2:
        raise ValueError(f"t_interval: {len(values)} values; an interval needs at least 2")
    half = t_quantile((1 + level) / 2, len(values) - 1) * statistics.stdev(values)
    half /= math.sqrt(len(values))
    center = statistics.mean(values)
    return center - half, center + half


def collapsed_seeds(late_rewards):
    """The seeds whose late reward is below COLLAPSE_BELOW, of {seed: late reward}."""
    return sorted(seed for seed, reward in late_rewards.items() if reward < COLLAPSE_BELOW)


# ----------------------------------------------------------------------------- reading runs
def open_metrics(run_dir):
    """The run's metrics.jsonl as train.py wrote it, or gzipped (metrics.jsonl.gz: the studies'),
    open for reading text."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(path):
        return open(path)
    return gzip.open(path + ".gz", "rt")


def records_of(run_dir):
    """Every record of the run's metrics."""
    with open_metrics(run_dir) as f:
        return [json.loads(line) for line in f if line.strip()]


def steps_of(records):
    """The RL steps' records (step 0 holds only the first evaluation)."""
    return [r for r in records if r["step"] > 0]


def evals_of(records):
    return [r for r in records if "pass@1" in r]


def mean(records, key, lo=0, hi=10**9):
    """Mean of `key` over the records of steps lo < step <= hi (NaN values skipped)."""
    values = [r[key] for r in records if lo < r["step"] <= hi and not math.isnan(r[key])]
    return sum(values) / len(values) if values else float("nan")


def run_folders(base, suffix=""):
    """{(recipe, seed): folder} of the runs in `base` named recipe<suffix>_s<seed>."""
    folders = {}
    for name in sorted(os.listdir(base)):
        head, _, seed = name.rpartition("_s")
        path = os.path.join(base, name)
        if seed.isdigit() and head.endswith(suffix) and os.path.isdir(path):
            folders[head[: len(head) - len(suffix)], int(seed)] = path
    return folders


def finished_runs(base=REPLICATION, suffix="", steps=600):
    """{recipe: {seed: records}} of the runs recipe<suffix>_s<seed> that reached step `steps`."""
    runs = {}
    for (recipe, seed), path in run_folders(base, suffix).items():
        records = records_of(path)
        if records and records[-1]["step"] == steps:
            runs.setdefault(recipe, {})[seed] = records
    return runs


def paths_of(base, runs, suffix=""):
    """The folders of `runs` ({recipe: {seed: records}}), for their provenance."""
    return [os.path.join(base, f"{r}{suffix}_s{s}") for r in runs for s in runs[r]]


WIDTH_RECIPES = ("bf16", "nvfp4", "quads")


def width_runs(widths=(128, 256)):
    """{width: {recipe: {seed: records}}}: the replication's bf16, nvfp4 and quads at width 64, the
    sweep's runs recipe_d<width>_s<seed> at the others."""
    out = {64: {r: v for r, v in finished_runs().items() if r in WIDTH_RECIPES}}
    for width in widths:
        runs = finished_runs(WIDTH_SWEEP, f"_d{width}")
        out[width] = {r: v for r, v in runs.items() if r in WIDTH_RECIPES}
    return out


def width_paths(sweep):
    """The folders of the sweep's runs, width 64's in the replication's folder."""
    paths = []
    for width, runs in sweep.items():
        if width == 64:
            paths += paths_of(REPLICATION, runs)
        else:
            paths += paths_of(WIDTH_SWEEP, runs, f"_d{width}")
    return paths


def probe_runs(base=WIDTH_SWEEP):
    """The probes: short runs of other shapes (folders probe_*), with width, depth and recipe."""
    probes = []
    for name in sorted(n for n in os.listdir(base) if n.startswith("probe_")):
        path = os.path.join(base, name)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        fields = dict(item.split("=") for item in config["preset_overrides"].split(","))
        probes.append(
            {
                "dim": fields.get("dim", "64"),
                "n_layers": fields.get("n_layers", "2"),
                "recipe": config["recipe"],
                "records": records_of(path),
                "path": path,
            }
        )
    return probes


# ----------------------------------------------------------------------------- provenance
def recorded_provenance(path):
    """The provenance entries a run folder's config.json holds ([] for a file or an older run)."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return []
    with open(config) as f:
        return json.load(f).get("provenance", [])


def commit_label(entry):
    """A recorded start's commit, short, marked when tracked files had uncommitted changes."""
    if entry.get("commit") is None:
        return "unknown commit"
    label = entry["commit"][:7]
    if entry.get("dirty"):
        label += " (uncommitted changes)"
    return label


def known_key(path):
    """The KNOWN_PROVENANCE key that applies to a path under results/ (None if none does)."""
    relative = os.path.relpath(path, HERE).replace(os.sep, "/")
    keys = [key for key in KNOWN_PROVENANCE if relative.startswith(key)]
    return max(keys, key=len) if keys else None


def provenance(paths):
    """(commits, lines) of the runs and reports at `paths`: every commit they ran on, and one line
    per kind of provenance, recorded or known, with how many runs, reports or starts it covers."""
    commits = []
    recorded = {}
    known = {}
    for path in paths:
        entries = recorded_provenance(path)
        for entry in entries:
            label = commit_label(entry)
            commits.append(label)
            start = (
                f"commit {label}, {entry.get('device')}, torch {entry.get('torch')}, "
                f"Triton {entry.get('triton')}, Python {entry.get('python')}"
            )
            recorded[start] = recorded.get(start, 0) + 1
        if not entries:
            key = known_key(path)
            kind = "runs" if os.path.isdir(path) else "reports"
            known[key, kind] = known.get((key, kind), 0) + 1
            commits += KNOWN_PROVENANCE[key][0] if key else ["unknown commit"]
    lines = [f"recorded in config.json, {n} start(s): {start}" for start, n in recorded.items()]
    for (key, kind), n in known.items():
        if key is None:
            lines.append(f"{n} {kind} with no provenance recorded, and none known")
        else:
            noun = kind if n > 1 else kind[:-1]
            lines.append(
                f"{n} {noun} of {key.split('/')[0]}, not recorded; known from results/LOG.md, the "
                f"folder's README and checks: {KNOWN_PROVENANCE[key][1]}"
            )
    return list(dict.fromkeys(commits)), lines


def caption(title, paths, mixes=None):
    """The lines under a table's title: its provenance, and why it may mix commits when it does.
    Stops the script with one line if the runs span several commits and `mixes` gives no reason."""
    commits, lines = provenance(paths)
    if len(commits) > 1 and not mixes:
        raise SystemExit(
            f"study_tables: table '{title}' mixes commits {', '.join(commits)}; "
            "give it a caption that says why it may, or split it"
        )
    text = "Provenance: " + "; ".join(lines) + "."
    if len(commits) > 1:
        text += f" Mixes commits {', '.join(commits)}: {mixes}"
    return paragraph(text)


def paragraph(text):
    """Text wrapped to the 100 columns of RESULTS.md's lines."""
    return textwrap.fill(text, width=100, break_on_hyphens=False, break_long_words=False)


# ----------------------------------------------------------------------------- tables
def table(header, rows, align=None):
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    return "\n".join(
        ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
        + ["| " + " | ".join(row) + " |" for row in rows]
    )


def late_reward(records):
    return mean(steps_of(records), "reward", 300)


METRICS = [  # (column, format, value of one run's records)
    ("late reward (301-600)", ".3f", late_reward),
    ("final pass@1, rollout", ".3f", lambda r: evals_of(r)[-1]["pass@1"]),
    ("final pass@1, BF16 trainer", ".3f", lambda r: evals_of(r)[-1]["pass@1_bf16_trainer"]),
    ("mean abs dlogp", ".2e", lambda r: mean(steps_of(r), "mismatch/abs_diff_mean")),
    ("per-step max abs dlogp", ".2f", lambda r: mean(steps_of(r), "mismatch/abs_diff_max")),
    ("routing disagr.", ".1%", lambda r: mean(steps_of(r), "routing_disagreement")),
    (
        "gap growth (501-600 / 1-100)",
        ".2f",
        lambda r: (
            mean(steps_of(r), "mismatch/abs_diff_mean", 500)
            / mean(steps_of(r), "mismatch/abs_diff_mean", 0, 100)
        ),
    ),
]


def run_values(runs, metrics=METRICS, order=ORDER):
    """{recipe: {seed: [metric values]}} in `order`."""
    return {
        r: {s: [f(records) for _, _, f in metrics] for s, records in sorted(runs[r].items())}
        for r in order
        if r in runs
    }


def paired(values, recipe, reference, index):
    """Per-seed differences recipe - reference of metric `index`, on the seeds both have."""
    seeds = sorted(set(values[recipe]) & set(values.get(reference, {})))
    return [values[recipe][s][index] - values[reference][s][index] for s in seeds]


def difference_cell(diffs, fmt="+.3f"):
    """The mean paired difference and its 95% t-interval (n >= 2), or '-' without pairs."""
    if not diffs:
        return "-"
    if len(diffs) < 2:
        return f"{diffs[0]:{fmt}} (one seed)"
    low, high = t_interval(diffs)
    return f"{statistics.mean(diffs):{fmt}} [{low:{fmt}}, {high:{fmt}}]"


def collapse_cell(late_rewards):
    """How many seeds collapsed, and which: '0', '1 (seed 4)', '2 (seeds 4, 5)'."""
    seeds = collapsed_seeds(late_rewards)
    if not seeds:
        return "0"
    names = ", ".join(str(s) for s in seeds)
    return f"{len(seeds)} (seed{'s' if len(seeds) > 1 else ''} {names})"


def column(values, recipe, index):
    return [x[index] for x in values[recipe].values()]


def seed_mean_rows(values, metrics=METRICS):
    """[recipe, seeds, the seed mean of each metric] per recipe."""
    return [
        [r, str(len(v))]
        + [
            f"{statistics.mean(column(values, r, i)):{fmt}}"
            for i, (_, fmt, _) in enumerate(metrics)
        ]
        for r, v in values.items()
    ]


def per_recipe_table(values):
    return table(["recipe", "seeds"] + [c for c, _, _ in METRICS], seed_mean_rows(values))


def headline_table(values):
    """Per recipe: collapsed seeds; late reward and final pass@1 as mean and median over seeds, and
    the mean paired per-seed difference against bf16 and against nvfp4 with its 95% t-interval."""
    rows = []
    for recipe, v in values.items():
        row = [recipe, str(len(v)), collapse_cell({s: x[0] for s, x in v.items()})]
        for index in (0, 1):
            row.append(f"{statistics.mean(column(values, recipe, index)):.3f}")
            row.append(f"{statistics.median(column(values, recipe, index)):.3f}")
            for reference in ("bf16", "nvfp4"):
                if recipe == reference:
                    row.append("-")
                else:
                    row.append(difference_cell(paired(values, recipe, reference, index)))
        rows.append(row)
    header = [
        "recipe",
        "seeds",
        f"collapsed (late reward < {COLLAPSE_BELOW})",
        "late reward, mean",
        "median",
        "minus bf16",
        "minus nvfp4",
        "final pass@1, mean",
        "median",
        "minus bf16",
        "minus nvfp4",
    ]
    return table(header, rows)


# The comparisons RESULTS.md words: (recipe, reference) paired per seed.
CLAIMS = [
    ("nvfp4", "bf16"),
    ("w4a16", "bf16"),
    ("w16a4", "bf16"),
    ("w16a4", "w4a16"),
    ("fp8", "bf16"),
    ("quads", "bf16"),
    ("quads", "nvfp4"),
    ("qat", "nvfp4"),
    ("rac", "nvfp4"),
    ("moeresq", "nvfp4"),
    ("trace", "nvfp4"),
    ("nvfp4+row", "nvfp4"),
    ("quads+row", "quads"),
    ("quads", "fp8"),
    ("quads", "w4a16"),
    ("moeresq", "quads"),
    ("trace", "quads"),
]


def seeds_above_zero(diffs):
    return f"{sum(d > 0 for d in diffs)}/{len(diffs)}"


def claims_table(values, pairs=CLAIMS):
    """Per pair, paired per seed: late reward's mean difference, 95% t-interval, median difference
    and the seeds on which it is positive; the same difference as a share of naive NVFP4's mean loss
    (bf16 - nvfp4, late reward, the same seeds); final pass@1's mean difference and its positive
    seeds."""
    rows = []
    for recipe, reference in pairs:
        if recipe not in values or reference not in values:
            continue
        late = paired(values, recipe, reference, 0)
        final = paired(values, recipe, reference, 1)
        loss = statistics.mean(paired(values, "bf16", "nvfp4", 0))
        low, high = t_interval(late)
        share = f"{statistics.mean(late) / loss:+.0%} [{low / loss:+.0%}, {high / loss:+.0%}]"
        rows.append(
            [
                f"{recipe} minus {reference}",
                difference_cell(late),
                f"{statistics.median(late):+.3f}",
                seeds_above_zero(late),
                share,
                difference_cell(final),
                seeds_above_zero(final),
            ]
        )
    header = [
        "pair",
        "late reward",
        "median",
        "seeds above 0",
        "as a share of bf16 minus nvfp4",
        "final pass@1",
        "seeds above 0",
    ]
    return table(header, rows)


def row_scale_table(values):
    """The per-row activation scale against the per-tensor one, paired per seed."""
    rows = [
        [f"{recipe}+row minus {recipe}"]
        + [difference_cell(paired(values, f"{recipe}+row", recipe, i)) for i in (0, 1, 3)]
        for recipe in ("nvfp4", "quads")
        if f"{recipe}+row" in values and recipe in values
    ]
    return table(["pair", "late reward", "final pass@1", "mean abs dlogp"], rows)


def width_table(sweep):
    """Per width: the warm-started policy's pass@1; the paired per-seed differences nvfp4 - bf16 of
    the reward of steps 1-100 (while even the widest BF16 policy has room to learn) and of late
    reward (the failure criterion); late reward per recipe (mean and median); collapsed seeds;
    QUADS's recovery (quads - nvfp4); final pass@1 nvfp4 - bf16."""
    early = ("reward 1-100", ".3f", lambda records: mean(steps_of(records), "reward", 0, 100))
    rows = []
    for width, runs in sweep.items():
        values = run_values(runs, METRICS + [early])
        start = [evals_of(rec)[0]["pass@1"] for rec in runs.get("bf16", {}).values()]
        seeds = "/".join(str(len(runs.get(r, {}))) for r in WIDTH_RECIPES)
        late = []
        collapsed = []
        for recipe in WIDTH_RECIPES:
            if recipe not in values:
                late.append("-")
                collapsed.append("-")
                continue
            rewards = column(values, recipe, 0)
            late.append(f"{statistics.mean(rewards):.3f} ({statistics.median(rewards):.3f})")
            collapsed.append(str(len(collapsed_seeds(dict(enumerate(rewards))))))
        diffs = [
            difference_cell(paired(values, a, b, i)) if a in values and b in values else "-"
            for a, b, i in (
                ("nvfp4", "bf16", len(METRICS)),
                ("nvfp4", "bf16", 0),
                ("quads", "nvfp4", 0),
                ("nvfp4", "bf16", 1),
            )
        ]
        rows.append(
            [str(width), seeds, f"{statistics.mean(start):.3f}" if start else "-"]
            + diffs[:1]
            + late
            + ["/".join(collapsed)]
            + diffs[1:]
        )
    header = [
        "width",
        "seeds (bf16/nvfp4/quads)",
        "pass@1 at step 0",
        "reward 1-100, nvfp4 minus bf16",
        "late reward bf16, mean (median)",
        "nvfp4",
        "quads",
        "collapsed",
        "late reward, nvfp4 minus bf16",
        "quads minus nvfp4",
        "final pass@1, nvfp4 minus bf16",
    ]
    return table(header, rows)


GAP_METRICS = [
    (
        "mean abs dlogp, steps 1-100",
        ".2e",
        lambda r: mean(steps_of(r), "mismatch/abs_diff_mean", 0, 100),
    ),
    ("steps 1-600", *METRICS[3][1:]),
    ("per-step max", *METRICS[4][1:]),
    METRICS[6],
    METRICS[5],
    ("trainer perplexity", ".3f", lambda r: mean(steps_of(r), "mismatch/trainer_ppl")),
]


def width_gap_table(sweep):
    """Per width and recipe, seed means: the train/rollout gap over the first 100 steps and all 600,
    its per-step max and growth, routing disagreement, and the trainer's perplexity of the sampled
    tokens."""
    rows = [
        [str(width)] + row
        for width, runs in sweep.items()
        for row in seed_mean_rows(run_values(runs, GAP_METRICS), GAP_METRICS)
    ]
    return table(
        ["width", "recipe", "seeds"] + [c for c, _, _ in GAP_METRICS],
        rows,
        ["---:", "---"] + ["---:"] * 7,
    )


def nll(records):
    """The trainer's mean negative log-prob a sampled token, ln of its perplexity, per step."""
    return [dict(r, nll=math.log(r["mismatch/trainer_ppl"])) for r in records]


def uncertainty_table(sweep, probes, steps=10):
    """The gap at the start of RL (steps 1-10) against how uncertain the policy is there (the
    trainer's mean negative log-prob a sampled token): a token's |delta logp| is about (1 - p) times
    the error of its logit margins, so gap / NLL estimates the logit error itself. Per run the ratio
    of its gap to its NLL; per row their mean, with a 95% t-interval over the seeds where there are
    several. Rows: the sweep, the probes (one run each), the small preset on the H200 (its 10-step
    quads run; nvfp4 from the audit's A-C MAE at that run's checkpoint, over the run's NLL)."""
    entries = [
        (f"{w}", "2", r, list(runs[r].values()))
        for w, runs in sweep.items()
        for r in ("nvfp4", "quads")
        if r in runs
    ]
    entries += [(p["dim"], p["n_layers"], p["recipe"], [p["records"]]) for p in probes]
    rows = []
    for width, layers, recipe, runs in sorted(entries, key=lambda e: (int(e[0]), int(e[1]), e[2])):
        gaps = [mean(steps_of(r), "mismatch/abs_diff_mean", 0, steps) for r in runs]
        uncertainties = [mean(nll(steps_of(r)), "nll", 0, steps) for r in runs]
        ratios = [gap / u for gap, u in zip(gaps, uncertainties)]
        if len(ratios) > 1:
            low, high = t_interval(ratios)
            interval = f"[{low:.3f}, {high:.3f}]"
        else:
            interval = "(one run)"
        rows.append(
            [
                width,
                layers,
                recipe,
                str(len(runs)),
                f"{statistics.mean(uncertainties):.3f}",
                f"{statistics.mean(gaps):.2e}",
                f"{statistics.mean(ratios):.3f}",
                interval,
            ]
        )
    small = steps_of(records_of(H200_AUDIT))
    uncertainty = mean(nll(small), "nll", 0, steps)
    audit_nvfp4 = [float(x) for x in audit_rows(os.path.join(H200_AUDIT, "audit.md"))["nvfp4"][2]]
    for recipe, gap in (
        ("nvfp4 (audit)", statistics.mean(audit_nvfp4)),
        ("quads", mean(small, "mismatch/abs_diff_mean", 0, steps)),
    ):
        rows.append(
            [
                "512 (small preset, H200)",
                "8",
                recipe,
                "1",
                f"{uncertainty:.3f}",
                f"{gap:.2e}",
                f"{gap / uncertainty:.3f}",
                "(one run)",
            ]
        )
    header = [
        "width",
        "layers",
        "recipe",
        "runs",
        "trainer NLL a token",
        "mean abs dlogp",
        "gap per nat of NLL",
        "95% t-interval",
    ]
    return table(header, rows, ["---", "---:", "---"] + ["---:"] * 5)


# ----------------------------------------------------------------------------- the GPU study
GPU_RECIPES = ("bf16", "nvfp4", "quads")
GPU_METRICS = [METRICS[0], METRICS[1], METRICS[3]]
GPU_CONDITIONS = (
    "preset",
    "difficulty",
    "steps",
    "prompts_per_step",
    "group_size",
    "lr",
    "warmstart_steps",
    "eval_prompts",
)


def no_signal_seeds(folders):
    """The seeds whose warm-start solved none of the held-out problems (step-0 pass@1 of the BF16
    trainer is 0, in any of the seed's runs): every reward of every recipe is then 0, and nothing
    is learned or compared. By the rule fixed in results/LOG.md before the later seeds ran, such a
    seed is named and replaced, not averaged."""
    seeds = set()
    for (recipe, seed), path in folders.items():
        with open_metrics(path) as f:
            line = f.readline()  # the first record is enough: the step-0 evaluation
        first = json.loads(line) if line.strip() else {}
        if first.get("step") == 0 and first.get("pass@1_bf16_trainer") == 0:
            seeds.add(seed)
    return sorted(seeds)


def gpu_study(base=GPU_STUDY):
    """The GPU regime: per recipe its collapsed seeds, late reward and final pass@1 (mean and
    median) and mean |delta logp|; then nvfp4 - bf16 and quads - nvfp4 paired per seed, with 95%
    t-intervals, and the failure criterion's verdict. Returns (text, run folders), or
    ("not run: ...", []) until the folder exists and holds a finished run."""
    name = os.path.relpath(base, os.path.dirname(HERE))
    if not os.path.isdir(base):
        return f"not run: {name} does not exist yet.", []
    folders = run_folders(base)
    replaced = no_signal_seeds(folders)
    runs = {}
    for recipe, seeds in finished_runs(base).items():
        kept = {seed: records for seed, records in seeds.items() if seed not in replaced}
        if recipe in GPU_RECIPES and kept:
            runs[recipe] = kept
    if not runs:
        return f"not run: {name} holds no run that reached step 600 ({len(folders)} started).", []
    values = run_values(runs, GPU_METRICS, GPU_RECIPES)
    paths = paths_of(base, runs)
    lines = [conditions(paths)]
    unfinished = sorted(
        f"{r}_s{s}" for r, s in folders if s not in runs.get(r, {}) and s not in replaced
    )
    if unfinished:
        lines.append(paragraph(f"Left out, not at step 600: {', '.join(unfinished)}."))
    if replaced:
        named = ", ".join(str(seed) for seed in replaced)
        label = "seeds" if len(replaced) > 1 else "seed"
        lines.append(
            paragraph(
                f"Replaced, by the rule in results/LOG.md: {label} {named}. A warm-start that "
                "solved none of the held-out problems (the BF16 trainer's step-0 pass@1 is 0) "
                "leaves no recipe a reward to learn from; the runs stay in the folder."
            )
        )
    rows = []
    for recipe, v in values.items():
        late = column(values, recipe, 0)
        final = column(values, recipe, 1)
        rows.append(
            [
                recipe,
                " ".join(str(s) for s in v),
                collapse_cell(dict(zip(v, late))),
                f"{statistics.mean(late):.3f}",
                f"{statistics.median(late):.3f}",
                f"{statistics.mean(final):.3f}",
                f"{statistics.median(final):.3f}",
                f"{statistics.mean(column(values, recipe, 2)):.2e}",
            ]
        )
    header = [
        "recipe",
        "seeds",
        f"collapsed (late reward < {COLLAPSE_BELOW})",
        "late reward, mean",
        "median",
        "final pass@1, mean",
        "median",
        "mean abs dlogp",
    ]
    lines += ["", table(header, rows), ""]
    pairs = [("nvfp4", "bf16"), ("quads", "nvfp4")]
    pair_rows = [
        [
            f"{recipe} minus {reference}",
            difference_cell(paired(values, recipe, reference, 0)),
            seeds_above_zero(paired(values, recipe, reference, 0)),
            difference_cell(paired(values, recipe, reference, 1)),
            difference_cell(paired(values, recipe, reference, 2), "+.2e"),
        ]
        for recipe, reference in pairs
        if recipe in values and reference in values
    ]
    pair_header = ["pair", "late reward", "seeds above 0", "final pass@1", "mean abs dlogp"]
    lines.append(table(pair_header, pair_rows))
    if "nvfp4" in values and "bf16" in values:
        lines += ["", paragraph(failure_verdict(paired(values, "nvfp4", "bf16", 0)))]
    return "\n".join(lines), paths


def failure_verdict(diffs):
    """The failure criterion, fixed before the runs: naive NVFP4 fails if its late reward is at
    least 0.10 below BF16's, with the 95% t-interval of the paired per-seed difference excluding
    zero."""
    if len(diffs) < 2:
        return f"Failure criterion: not decidable on {len(diffs)} paired seed(s)."
    low, high = t_interval(diffs)
    fails = statistics.mean(diffs) <= -0.10 and high < 0
    verdict = "met: naive NVFP4 fails" if fails else "not met"
    return (
        "Failure criterion (late reward at least 0.10 below bf16's, interval excluding 0): "
        f"{verdict} ({statistics.mean(diffs):+.3f} [{low:+.3f}, {high:+.3f}], {len(diffs)} seeds)."
    )


def conditions(paths, keys=GPU_CONDITIONS):
    """The runs' settings as their config.json recorded them, each value with its number of runs."""
    seen = {key: {} for key in keys}
    for path in paths:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        for key in keys:
            value = str(config.get(key))
            seen[key][value] = seen[key].get(value, 0) + 1
    parts = []
    for key, values in seen.items():
        if len(values) == 1:
            parts.append(f"{key} {next(iter(values))}")
        else:
            parts.append(f"{key} " + " / ".join(f"{v} ({n} runs)" for v, n in values.items()))
    return paragraph("Conditions (config.json): " + ", ".join(parts) + ".")


# ----------------------------------------------------------------------------- the figures
def smooth(values, window):
    """Trailing mean over the last `window` values (fewer at the start): per-step RL metrics are
    noisy."""
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(
    runs, values, path, recipes=("bf16", "w4a16", "quads", "trace", "w16a4", "nvfp4"), window=25
):
    """Train reward and mean |delta logp| over steps (seed means, trailing 25-step means); each
    recipe's late reward per seed (collapsed seeds in red), and its seed mean with the 95%
    t-interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    seeds = sorted(set.union(*(set(runs[r]) for r in ORDER if r in runs)))
    n_runs = sum(len(runs[r]) for r in ORDER if r in runs)
    for recipe in recipes:
        per_seed = [steps_of(runs[recipe][s]) for s in runs[recipe]]
        for ax, key in zip(axes[:2], ("reward", "mismatch/abs_diff_mean")):
            curve = [statistics.mean(s[i][key] for s in per_seed) for i in range(600)]
            ax.plot(range(1, 601), smooth(curve, window), label=f"{recipe} ({len(per_seed)} seeds)")
    axes[0].set_title(f"train reward, seed mean, {window}-step mean", fontsize=10)
    axes[1].set_title(f"mean |delta logp| rollout vs trainer, {window}-step mean", fontsize=10)
    axes[1].set_yscale("log")
    for ax in axes[:2]:
        ax.set_xlabel("RL step", fontsize=9)
    axes[0].legend(fontsize=8)
    names = list(values)
    for x, recipe in enumerate(names):
        late = column(values, recipe, 0)
        colors = ["C3" if r < COLLAPSE_BELOW else "0.6" for r in late]
        axes[2].scatter([x + 0.18] * len(late), late, s=10, c=colors, zorder=2)
        low, high = t_interval(late)
        center = statistics.mean(late)
        axes[2].errorbar([x], [center], yerr=[[center - low], [high - center]], fmt="o", color="C0")
    axes[2].axhline(COLLAPSE_BELOW, ls=":", color="C3", lw=1)
    axes[2].set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    axes[2].set_title(
        f"late reward 301-600 per seed (red: < {COLLAPSE_BELOW}); mean, 95% t-interval",
        fontsize=9,
    )
    fig.suptitle(
        f"CPU, tiny preset, {n_runs} runs, seeds {min(seeds)}-{max(seeds)} (per recipe in the "
        f"legend and RESULTS.md), commits f233fbb and 8d36956: {COMMAND}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_widths(sweep, path, window=25):
    """Per width, train reward of each recipe (seed means, trailing 25-step means); then nvfp4's and
    quads's mean |delta logp| at every width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweep) + 1, figsize=(4.6 * (len(sweep) + 1), 4.2))
    for ax, (width, runs) in zip(axes, sweep.items()):
        for recipe in (r for r in WIDTH_RECIPES if r in runs):
            per_seed = [steps_of(rec) for rec in runs[recipe].values()]
            curve = [statistics.mean(s[i]["reward"] for s in per_seed) for i in range(600)]
            ax.plot(range(1, 601), smooth(curve, window), label=f"{recipe} ({len(per_seed)} seeds)")
            if recipe != "bf16":
                gap = [
                    statistics.mean(s[i]["mismatch/abs_diff_mean"] for s in per_seed)
                    for i in range(600)
                ]
                axes[-1].plot(
                    range(1, 601),
                    smooth(gap, window),
                    label=f"{recipe}, width {width}",
                    ls="-" if recipe == "nvfp4" else "--",
                    color=f"C{list(sweep).index(width)}",
                )
        ax.set_title(f"width {width}: train reward, seed mean, {window}-step mean", fontsize=9)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    axes[-1].set_yscale("log")
    axes[-1].set_title(f"mean |delta logp| rollout vs trainer, {window}-step mean", fontsize=9)
    axes[-1].legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("RL step", fontsize=9)
    fig.suptitle(
        "CPU, tiny preset at width 64 (the replication's runs, commits f233fbb and 8d36956) and "
        "widened (commit 0c80b9c); seeds per recipe in the legends\npython train.py --recipe R "
        "--steps 600 --lr 3e-4 --eval-prompts 512 --seed S [--preset-overrides "
        "dim=W,head_dim=W/4,expert_dim=W]",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------- RESULTS.md
def audit_rows(path):
    """{recipe: [[A-B MAE, B-C MAE, A-C MAE, A-C p99] per batch]} from the audit.md tools.audit
    wrote, as printed there."""
    rows = {}
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| ") and cells[0] != "recipe" and not cells[0].startswith("---"):
                rows.setdefault(cells[0].split(" (batch")[0], []).append(
                    [cells[i] for i in (3, 8, 13, 15)]
                )
    return {name: [list(column) for column in zip(*batches)] for name, batches in rows.items()}


def audit_summary(path):
    """The audit's mean absolute errors (A-B, B-C, A-C) and A-C p99, one row per recipe, its batches
    side by side."""
    return table(
        ["recipe", "A-B MAE", "B-C MAE", "A-C MAE", "A-C p99"],
        [
            [name] + [" / ".join(column) for column in columns]
            for name, columns in audit_rows(path).items()
        ],
    )


def outlier_summary(reports):
    """{model: outliers.md} -> per model and kind of input (over its layers): the range of max/RMS,
    of the largest over the median block amax, of the blocks below 2^-6, and of the relative error
    per tensor / row."""
    rows = []
    for model, path in reports.items():
        kinds = {}
        with open(path) as f:
            for line in f:
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if cells[0].startswith("layers."):
                    kind = cells[0].split(".", 2)[2].replace("q_proj (+2 sharing it)", "q/k/v_proj")
                    kinds.setdefault(kind, []).append([float(c) for c in cells[2:]])
        for kind, layers in kinds.items():
            ranges = [
                f"{min(v):.3g}" + (f"-{max(v):.3g}" if max(v) > min(v) else "")
                for v in zip(*layers)
            ]
            rows.append(
                [model, f"{kind} ({len(layers)} layers)"]
                + ranges[:3]
                + [f"{ranges[3]} / {ranges[4]}"]
            )
    return table(
        [
            "model",
            "input",
            "max/RMS",
            "block amax max/median",
            "blocks below 2^-6",
            "rel. error, tensor / row scale",
        ],
        rows,
        ["---", "---"] + ["---:"] * 4,
    )


def main():
    runs = finished_runs()
    values = run_values(runs)
    replication = paths_of(REPLICATION, runs)
    sweep = width_runs()
    probes = probe_runs()
    outlier_reports = {
        "small, H200 (quads, step 10)": os.path.join(H200_AUDIT, "outliers.md"),
        "tiny, CPU (bf16 seed 0, step 600)": os.path.join(REPLICATION, "outliers_bf16_s0.md"),
        "tiny, CPU (nvfp4 seed 0, step 600)": os.path.join(REPLICATION, "outliers_nvfp4_s0.md"),
    }
    gpu_text, gpu_paths = gpu_study()
    sections = [  # (title, table, the runs and reports it reads, why it may mix commits)
        (
            "The replication: collapses, late reward and final pass@1, paired per seed",
            INTERVALS + "\n\n" + headline_table(values),
            replication,
            REPLICATION_MIX,
        ),
        (
            "The replication: the comparisons the text makes, paired per seed",
            INTERVALS + "\n\n" + claims_table(values),
            replication,
            REPLICATION_MIX,
        ),
        (
            "The replication: every metric, seed means",
            per_recipe_table(values),
            replication,
            REPLICATION_MIX,
        ),
        (
            "Per-row against per-tensor activation scales, paired per seed",
            INTERVALS + "\n\n" + row_scale_table(values),
            replication,
            REPLICATION_MIX,
        ),
        (
            "H200: the log-prob audit of a small-preset checkpoint, batch 1 / batch 2",
            audit_summary(os.path.join(H200_AUDIT, "audit.md")),
            [H200_AUDIT],
            None,
        ),
        (
            "The inputs NVFP4 quantizes: outliers per kind of input, range over layers",
            outlier_summary(outlier_reports),
            list(outlier_reports.values()),
            None,
        ),
        (
            "Width: the replication's three recipes on the tiny preset at widths 64, 128 and 256",
            INTERVALS + "\n\n" + width_table(sweep),
            width_paths(sweep),
            WIDTHS_MIX,
        ),
        (
            "Width: the train/rollout gap, seed means",
            width_gap_table(sweep),
            width_paths(sweep),
            WIDTHS_MIX,
        ),
        (
            "The gap at the start of RL against the policy's uncertainty, steps 1-10",
            uncertainty_table(sweep, probes),
            width_paths(sweep) + [p["path"] for p in probes] + [H200_AUDIT],
            WIDTHS_MIX[:-1] + "; " + SMALL_PRESET_MIX,
        ),
        (
            "GPU, small preset, 600 steps: bf16, nvfp4 and quads, paired per seed",
            gpu_text if not gpu_paths else INTERVALS + "\n" + gpu_text,
            gpu_paths,
            None,
        ),
    ]
    previous = None
    for title, text, paths, mixes in sections:
        head = caption(title, paths, mixes) + "\n\n" if paths else ""
        if paths and (paths, mixes) == previous:
            head = "Provenance: the runs of the table above.\n\n"
        previous = (paths, mixes)
        print(f"## {title}\n\n{head}{text}\n")
    os.makedirs(FIGURES, exist_ok=True)
    plot(runs, values, os.path.join(FIGURES, "cpu_replication_600steps.png"))
    drawn = {width: runs for width, runs in sweep.items() if runs}
    plot_widths(drawn, os.path.join(FIGURES, "cpu_width_sweep.png"))
    print(f"figures written to {FIGURES}: cpu_replication_600steps.png, cpu_width_sweep.png")


if __name__ == "__main__":
    main()
