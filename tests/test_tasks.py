"""tasks.py: tokenizer, exact verifiers (including a fuzz that must never raise), imperfect
demonstrations, held-out split, and GSM8K loading from a local file (offline)."""

import json
import random

import pytest

from conftest import raises_one_line
from tasks import (
    TEST_FRACTION,
    ArithmeticTask,
    CharTokenizer,
    GSM8KTask,
    HFTokenizer,
    Problem,
    _in_test_split,
    extract_answer,
    make_task,
)


# -----------------------------------------------------------------------------
# CharTokenizer


def test_tokenizer_round_trip_and_specials():
    task = ArithmeticTask(difficulty=3)
    tok = task.tokenizer
    problem = task.sample(1, "train", random.Random(0))[0]
    text = problem.prompt + task.demonstration(problem, random.Random(0))
    ids = tok.encode(text)
    assert min(ids) >= 3 and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id] + tok.encode("999") + [tok.pad_id]) == text
    assert tok.decode([tok.pad_id, tok.bos_id] + tok.encode("1+2") + [tok.pad_id]) == "1+2"
    assert (
        tok.vocab_size == 3 + len(tok.alphabet) and len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
    )


def test_tokenizer_decode_never_raises_on_any_ids():
    tok = CharTokenizer("0123456789+=;>")
    assert tok.decode([tok.vocab_size, -1, 10**30]) == CharTokenizer.UNKNOWN * 3
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randint(-5, tok.vocab_size + 5) for _ in range(rng.randint(0, 40))]
        text = tok.decode(ids)
        assert isinstance(text, str) and len(text) <= len(ids)


# -----------------------------------------------------------------------------
# ArithmeticTask: verifier, demonstrations, split


def test_arith_reward_correct_wrong_and_garbage():
    task = ArithmeticTask(difficulty=3)
    problem = Problem(prompt="347+589=", answer="936")
    assert task.reward(problem, "7+9+0=16;4+8+1=13;3+5+1=09>936") == 1.0
    assert task.reward(problem, ">936") == 1.0  # outcome reward: the scratchpad is not graded
    assert task.reward(problem, "junk>0936 ") == 1.0  # leading zero and whitespace tolerated
    assert task.reward(problem, "7+9+0=16;4+8+0=12;3+5+1=09>926") == 0.0  # dropped carry
    for wrong in [
        "936",
        ">937",
        ">93",
        ">9360",
        ">936>1",
        ">936;",
        "> 9 36",
        ">",
        "",
        ">-936",
        ">936.0",
        ">\u0669\u0663\u0666",
        ">\u00b9\u00b2",
    ]:  # Arabic-Indic digits, superscripts
        assert task.reward(problem, wrong) == 0.0, wrong
    assert task.reward(problem, None) == 0.0
    assert task.reward(Problem("0+0=", "0"), "0+0+0=00>0") == 1.0
    assert task.reward(Problem("0+0=", "0"), ">000") == 1.0


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_clean_demonstrations_are_correct_short_and_encodable(difficulty):
    task = ArithmeticTask(difficulty=difficulty, demo_error_rate=0.0)
    rng = random.Random(difficulty)
    for problem in task.sample(300, "train", rng):
        demo = task.demonstration(problem, rng)
        assert task.reward(problem, demo) == 1.0, (problem, demo)
        assert (
            len(demo) <= task.max_completion_chars and len(problem.prompt) <= task.max_prompt_chars
        )
        task.tokenizer.encode(problem.prompt + demo)
    assert ArithmeticTask(difficulty=4).max_completion_chars <= 48


def _faulty_steps(demo):
    """Kinds of mistake in a scratchpad: 'slip' (a + b + carry != written sum) or 'dropped_carry'
    (carry-in differs from the previous step's tens digit while the sum itself is right)."""
    kinds, carry = [], 0
    for step in demo.split(">")[0].split(";"):
        terms, column_sum = step.split("=")
        a, b, carry_in = map(int, terms.split("+"))
        if a + b + carry_in != int(column_sum):
            kinds.append("slip")
        elif carry_in != carry:
            kinds.append("dropped_carry")
        carry = int(column_sum) // 10
    return kinds


@pytest.mark.parametrize("rate", [0.3, 1.0])
def test_demonstrations_are_wrong_at_the_given_rate(rate):
    task = ArithmeticTask(difficulty=3, demo_error_rate=rate)
    rng = random.Random(1)
    problems = task.sample(3000, "train", rng)
    demos = [task.demonstration(problem, rng) for problem in problems]
    wrong = [task.reward(p, d) == 0.0 for p, d in zip(problems, demos)]
    assert sum(wrong) / len(problems) == pytest.approx(rate, abs=0.03)
    # A wrong demonstration has exactly one faulty step, the rest follows from what was written;
    # a right one has none. Both kinds of mistake occur.
    kinds = [_faulty_steps(d) for d in demos]
    assert all(len(k) == (1 if w else 0) for k, w in zip(kinds, wrong))
    counts = {kind: sum(k == [kind] for k in kinds) for kind in ("slip", "dropped_carry")}
    assert counts["slip"] > 0.2 * sum(wrong) and counts["dropped_carry"] > 0.2 * sum(wrong)


def test_train_and_test_problems_are_disjoint_and_seed_independent():
    rng = random.Random(0)
    task = ArithmeticTask(difficulty=2)

    def operand_pair(problem):
        a, b = map(int, problem.prompt.rstrip("=").split("+"))
        return min(a, b), max(a, b)

    train = {operand_pair(p) for p in task.sample(5000, "train", rng)}
    test = {operand_pair(p) for p in task.sample(1000, "test", rng)}
    assert train and test and not train & test
    # The split is a property of the problem: about TEST_FRACTION of the population, for any seed.
    population = [(a, b) for a in range(100) for b in range(100)]
    share = sum(_in_test_split(f"{min(a, b)}+{max(a, b)}") for a, b in population) / len(population)
    assert share == pytest.approx(TEST_FRACTION, abs=0.02)
    other_seed = ArithmeticTask(difficulty=2, seed=123)
    assert all(
        operand_pair(p) not in train for p in other_seed.sample(500, "test", random.Random(5))
    )
    # 1 digit: a tiny held-out set
    assert len(ArithmeticTask(difficulty=1).sample(20, "test", rng)) == 20


def test_sampling_is_reproducible_from_the_rng():
    task = ArithmeticTask(difficulty=3, demo_error_rate=0.5)

    def draw(seed):
        rng = random.Random(seed)
        problems = task.sample(20, "train", rng)
        return problems, [task.demonstration(p, rng) for p in problems]

    assert draw(7) == draw(7) and draw(7) != draw(8)


# -----------------------------------------------------------------------------
# GSM8K through a local jsonl (no network)

GSM8K_ROWS = [
    {
        "question": (
            "Mia buys 3 packs of 12 pencils and gives away 9. How many pencils does she have left?"
        ),
        "answer": (
            "She buys 3*12=<<3*12=36>>36 pencils.\nShe has 36-9=<<36-9=27>>27 left.\n#### 27"
        ),
    },
    {
        "question": "A farm sells 1,250 eggs a day for 5 days. How many eggs is that?",
        "answer": "That is 1,250*5=<<1250*5=6250>>6,250 eggs.\n#### 6,250",
    },
    {
        "question": "A shirt costs $20 and is 15% off. What is the sale price in dollars?",
        "answer": (
            "The discount is 20*0.15=<<20*0.15=3>>3 dollars.\n"
            "The price is 20-3=<<20-3=17>>17.\n#### 17"
        ),
    },
    {
        "question": "The temperature was 4 degrees and fell by 10 degrees. What is it now?",
        "answer": "It is 4-10=<<4-10=-6>>-6 degrees.\n#### -6",
    },
    {
        "question": (
            "Tom splits 7 liters of juice equally into 2 bottles. How many liters per bottle?"
        ),
        "answer": "Each bottle gets 7/2=<<7/2=3.5>>3.5 liters.\n#### 3.5",
    },
] + [
    {
        "question": f"What is {i} plus {i}?",
        "answer": f"{i}+{i}=<<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}",
    }
    for i in range(40)
]


@pytest.fixture(scope="module")
def gsm8k_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gsm8k") / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    return str(path)


@pytest.fixture(scope="module")
def gsm8k_task(gsm8k_file):
    return GSM8KTask(source=gsm8k_file)


def test_gsm8k_local_file_loads_answers_and_split(gsm8k_task, gsm8k_file):
    train, test = gsm8k_task.problems["train"], gsm8k_task.problems["test"]
    assert len(train) + len(test) == len(GSM8K_ROWS) and train and test
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    by_question = {p.prompt.split("\n")[0]: p for p in train + test}
    assert by_question[GSM8K_ROWS[0]["question"]].answer == "27"
    assert by_question[GSM8K_ROWS[1]["question"]].answer == "6250"
    assert by_question[GSM8K_ROWS[3]["question"]].answer == "-6"
    assert by_question[GSM8K_ROWS[4]["question"]].answer == "3.5"
    for problem in train + test:
        demo = gsm8k_task.demonstration(problem, random.Random(0))
        assert "<<" not in demo and demo.rstrip().splitlines()[-1].startswith("####")
        assert gsm8k_task.reward(problem, demo) == 1.0
        assert "####" in problem.prompt  # the instruction names the answer format
    # A separate test file replaces the hash split; sampling is without replacement when possible.
    separate = make_task("gsm8k", source=gsm8k_file, test_source=gsm8k_file)
    assert len(separate.problems["test"]) == len(GSM8K_ROWS)
    drawn = separate.sample(len(GSM8K_ROWS), "test", random.Random(0))
    assert len({p.prompt for p in drawn}) == len(GSM8K_ROWS)
    assert len(separate.sample(100, "train", random.Random(0))) == 100


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("She has 36-9=27 left.\n#### 27", 1.0),
        ("#### 27.0", 1.0),
        ("#### 27.0000001", 1.0),  # within 1e-6
        ("#### 27.00001", 0.0),
        ("So the answer is 27.", 1.0),  # no marker: last number
        ("27 pencils, not 28", 0.0),
        ("I guess 27 at first... #### 28", 0.0),  # the marker wins over earlier numbers
        ("#### 28\nActually 27", 0.0),
        ("The answer is $\\boxed{27}$ (checked with 3 steps)", 1.0),
        ("\\boxed{\\frac{54}{2} = 27}", 1.0),
        ("\\boxed{27", 1.0),  # an unclosed box is ignored: the last number in the text counts
        ("\\boxed{28", 0.0),
        ("nothing numeric here", 0.0),
        ("####", 0.0),
        ("", 0.0),
    ],
)
def test_gsm8k_reward_extraction(gsm8k_task, completion, expected):
    problem = Problem(prompt="q", answer="27")
    assert gsm8k_task.reward(problem, completion) == expected


def test_gsm8k_reward_commas_negatives_decimals(gsm8k_task):
    assert gsm8k_task.reward(Problem("q", "6250"), "so 6,250 eggs. #### 6,250") == 1.0
    assert gsm8k_task.reward(Problem("q", "1234567"), "The total is 1,234,567") == 1.0
    assert gsm8k_task.reward(Problem("q", "-6"), "It is -6 degrees") == 1.0
    assert gsm8k_task.reward(Problem("q", "-6"), "It is 6 degrees") == 0.0
    assert gsm8k_task.reward(Problem("q", "3.5"), "#### $3.50") == 1.0
    assert extract_answer("pay $1,000.50 today") == extract_answer("1000.5")


# -----------------------------------------------------------------------------
# Fuzz: rewards never raise and stay in [0, 1]


def _fuzz_strings(count, seed=0):
    rng = random.Random(seed)
    alphabet = "0123456789+-*/=;>#.,$ ()\\{}boxed\n" + "\u0663\u00b2\u2212\ufffd\U0001f600é中"
    fixed = [
        "(" * 10000,
        ")" * 10000,
        ">" + "9" * 10000,
        "9" * 100_000,
        "#### " + "9" * 100_000,
        "\\boxed{" * 2000,
        "\\boxed{" + "9" * 5000 + "}",
        "1" + ",0" * 20000,
        "-" * 5000 + "1",
        ">" * 5000,
        "#" * 5000,
        "0." + "0" * 5000 + "1",
        "1e999999",
        "nan",
        "inf",
        "#### nan",
        "\x00\x01\x02",
        "\ud800",
        "9" * 1_000_001,
    ]
    strings = list(fixed)
    while len(strings) < count:
        kind = rng.random()
        if kind < 0.6:
            strings.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))))
        elif kind < 0.8:
            strings.append(
                "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(0, 20)))
            )
        else:
            strings.append(
                rng.choice([">", "#### ", "\\boxed{", ""]) + str(rng.randint(-(10**60), 10**60))
            )
    return strings


def test_rewards_never_raise_on_any_string(gsm8k_task):
    arith = ArithmeticTask(difficulty=3)
    arith_problem = Problem("347+589=", "936")
    gsm_problem = Problem("q", "27")
    for text in _fuzz_strings(3000):
        for reward in (arith.reward(arith_problem, text), gsm8k_task.reward(gsm_problem, text)):
            assert reward in (0.0, 1.0)


def test_make_task_builds_the_named_task_with_its_arguments():
    task = make_task("arith", difficulty=2, demo_error_rate=0.1, seed=1)
    assert isinstance(task, ArithmeticTask) and task.difficulty == 2 and task.name == "arith"
    assert task.demo_error_rate == 0.1


# -----------------------------------------------------------------------------
# Bad input: one line naming the argument and the problem


def _gsm8k_file(directory, rows):
    path = directory / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# (id, call given a scratch directory, exception, what the message names, the problem)
BAD_CALLS = [
    (
        "character",
        lambda tmp: CharTokenizer("0123456789+").encode("1+x"),
        ValueError,
        "'x'",
        "not in the alphabet",
    ),
    ("alphabet", lambda tmp: CharTokenizer("0120"), ValueError, "alphabet", "distinct"),
    (
        "difficulty",
        lambda tmp: ArithmeticTask(difficulty=0),
        ValueError,
        "difficulty",
        ">= 1, got 0",
    ),
    (
        "error rate",
        lambda tmp: ArithmeticTask(demo_error_rate=1.5),
        ValueError,
        "demo_error_rate",
        "[0, 1], got 1.5",
    ),
    (
        "split",
        lambda tmp: ArithmeticTask().sample(1, "validation"),
        ValueError,
        "split",
        "'validation'",
    ),
    (
        "gsm8k split",
        lambda tmp: GSM8KTask(source=_gsm8k_file(tmp, GSM8K_ROWS)).sample(1, "dev"),
        ValueError,
        "split",
        "'dev'",
    ),
    (
        "fields",
        lambda tmp: GSM8KTask(source=_gsm8k_file(tmp, [{"problem": "1+1?", "solution": "2"}])),
        ValueError,
        "question",
        "lacks the field",
    ),
    (
        "no answer",
        lambda tmp: GSM8KTask(source=_gsm8k_file(tmp, [{"question": "1+1?", "answer": "2"}])),
        ValueError,
        "####",
        "no",
    ),
    (
        "missing file",
        lambda tmp: GSM8KTask(source=str(tmp / "absent.jsonl")),
        FileNotFoundError,
        "absent.jsonl",
        "no such",
    ),
    ("task", lambda tmp: make_task("countdown"), ValueError, "'countdown'", "available"),
]


@pytest.mark.parametrize(
    "call, error, names, problem",
    [case[1:] for case in BAD_CALLS],
    ids=[case[0] for case in BAD_CALLS],
)
def test_bad_input_raises_one_line_naming_the_argument_and_the_problem(
    tmp_path, call, error, names, problem
):
    raises_one_line(lambda: call(tmp_path), names, problem, error)


class _FakeHFTokenizer:
    """The few attributes and methods of a Hugging Face tokenizer that HFTokenizer uses: one id per
    char."""

    def __init__(self, eos_token_id, pad_token_id):
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    def __len__(self):
        return 128

    def encode(self, text, add_special_tokens):
        assert add_special_tokens is False
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens):
        return "".join(chr(i) for i in ids)


def test_hf_tokenizer_stops_at_eos_and_pads_with_eos_when_it_has_no_pad():
    tokenizer = HFTokenizer(_FakeHFTokenizer(eos_token_id=3, pad_token_id=None))
    assert (tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size) == (3, 3, 128)
    assert tokenizer.decode(tokenizer.encode("#### 42") + [3] + tokenizer.encode("x")) == "#### 42"
    assert HFTokenizer(_FakeHFTokenizer(eos_token_id=3, pad_token_id=0)).pad_id == 0
    with pytest.raises(ValueError, match="has no EOS token"):
        HFTokenizer(_FakeHFTokenizer(eos_token_id=None, pad_token_id=0))
