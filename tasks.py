"""Tasks with verifiable rewards: a built-in synthetic arithmetic task with its own character
tokenizer, and GSM8K-style math loaded through `datasets`.

A task hands out problems, scores completions with an exact verifier (reward in [0, 1], never
raising, never evaluating model output as code) and writes demonstrations for the warm-start:

    task.name                                   "arith" | "gsm8k"
    task.tokenizer                              CharTokenizer, or None (the model's: HFTokenizer)
    task.sample(n, split, rng) -> [Problem]     split "train" | "test", disjoint populations
    task.demonstration(problem, rng) -> str     completion text for supervised warm-start
    task.reward(problem, completion) -> float   exact verifier, 0.0 or 1.0
    Problem(prompt, answer, solution="")        answer: what the verifier compares against

`rng` is a random.Random; when omitted, the task's own generator (seeded by `seed`) is used.

The synthetic task: multi-digit addition with a column scratchpad
------------------------------------------------------------------
    prompt      "347+589="
    completion  "7+9+0=16;4+8+1=13;3+5+1=09>936"        then EOS

One step per column, least significant first: digit of a, digit of b, carry in, and the two-digit
column sum whose tens digit is the next carry. The answer after ">" is the units digits of the steps
read back in reverse, plus the last carry. Reward 1 when the text after the last ">" is exactly the
sum's digits (surrounding whitespace and leading zeros tolerated), else 0: outcome reward only, the
scratchpad is not graded. Operands are uniform in [0, 10**difficulty): a prompt has at most
2*difficulty + 2 characters, a completion at most 10*difficulty + 1 (31 at difficulty 3, 41 at 4).

Why not Countdown: each character here is a function of a few earlier ones, so the tiny preset
learns it on a CPU (on Countdown its pass@1 stays near 0: all-zero groups, no RL signal); difficulty
is one smooth knob, completions are short, and the verifier compares strings, one correct answer.

Imperfect demonstrations. With probability `demo_error_rate` a demonstration has one human-like
mistake (a dropped carry, or a slipped units digit of one column sum), every later step consistent
with it; a column sum changed from s to s' moves the answer by (s' - s) * 10**column != 0, so it is
always wrong. Fitted to them, a model's sampled pass@1 is about 1 - demo_error_rate; RL on the
verifier pushes it back towards 1 (greedy decoding hides most mistakes: evaluate by sampling).

Held-out split: a problem is "test" when blake2b of its unordered operand pair falls in the lowest
TEST_FRACTION of the hash range: a property of the problem alone (not of the seed), so every run and
recipe is evaluated on the same held-out population, disjoint from "train" by construction.

GSM8K: grade-school math word problems with numeric answers (reference solutions end in "#### 72"),
from the Hugging Face hub (default "openai/gsm8k", config "main", its train/test splits) or a local
.jsonl/.json/.parquet file with fields question/answer (split by the same hash rule on the question
unless a separate test file is given). A completion's answer is the number after the last "####" if
there is one, else the last number inside the last \\boxed{...}, else the last number in the text;
commas are dropped and it is compared numerically (|x - y| <= 1e-6) with exact decimals.

Left out on purpose: partial or format rewards, chat templates, Countdown and other synthetic tasks.
"""

import hashlib
import os
import random
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation


@dataclass(frozen=True)
class Problem:
    prompt: str  # text given to the model
    answer: str  # what the verifier needs: canonical answer string ("936", "72")
    solution: str = ""  # reference solution text, where the task has one (GSM8K); "" otherwise


TEST_FRACTION = 0.1  # share of each task's problem population held out for evaluation


def _in_test_split(key: str) -> bool:
    """Membership of the held-out split, stable across processes and platforms (unlike hash())."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < TEST_FRACTION * 2**64


# -----------------------------------------------------------------------------
# Character tokenizer


class CharTokenizer:
    """One token per character of a fixed alphabet, after three special tokens.

    ids: 0 PAD, 1 BOS, 2 EOS, then the alphabet in order. `encode` maps text to ids with no
    specials (a sequence is [bos_id] + encode(prompt) + encode(completion) + [eos_id]); it raises
    ValueError on a character outside the alphabet (the tasks only encode their own text). `decode`
    never raises on integer ids: it stops at the first EOS, skips PAD and BOS, and renders unknown
    ids as UNKNOWN."""

    PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
    UNKNOWN = "\ufffd"  # the Unicode replacement character: never part of an alphabet

    def __init__(self, alphabet: str):
        if len(set(alphabet)) != len(alphabet) or self.UNKNOWN in alphabet:
            raise ValueError(
                f"alphabet must be distinct characters without {self.UNKNOWN!r}: {alphabet!r}"
            )
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.alphabet = alphabet
        self.vocab_size = 3 + len(alphabet)
        self._id_of = {char: 3 + i for i, char in enumerate(alphabet)}

    def encode(self, text: str) -> list[int]:
        try:
            return [self._id_of[char] for char in text]
        except KeyError as error:
            raise ValueError(
                f"character {error.args[0]!r} is not in the alphabet {self.alphabet!r}"
            ) from None

    def decode(self, ids) -> str:
        chars = []
        for token in ids:
            token = int(token)
            if token == self.eos_id:
                break
            if token in (self.pad_id, self.bos_id):
                continue
            chars.append(self.alphabet[token - 3] if 3 <= token < self.vocab_size else self.UNKNOWN)
        return "".join(chars)


# -----------------------------------------------------------------------------
# The synthetic task: addition with a column scratchpad


class ArithmeticTask:
    """Addition of two numbers in [0, 10**difficulty) with a column scratchpad (see the
    module docstring)."""

    name = "arith"

    def __init__(self, difficulty: int = 3, demo_error_rate: float = 0.5, seed: int = 0):
        if difficulty < 1:
            raise ValueError(f"difficulty (digits per operand) must be >= 1, got {difficulty}")
        if not 0.0 <= demo_error_rate <= 1.0:
            raise ValueError(f"demo_error_rate must be in [0, 1], got {demo_error_rate}")
        self.difficulty = difficulty  # digits per operand: columns of the scratchpad
        self.demo_error_rate = demo_error_rate  # share of demonstrations with one mistake
        self.rng = random.Random(seed)  # used only when a caller passes no rng
        self.tokenizer = CharTokenizer("0123456789+=;>")
        self.max_prompt_chars = 2 * difficulty + 2
        self.max_completion_chars = 10 * difficulty + 1  # d steps of 8, d-1 ';', '>', d+1 digits

    def sample(self, n: int, split: str, rng: random.Random | None = None) -> list[Problem]:
        """n problems drawn uniformly (with replacement) from the split's population."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        rng = rng or self.rng
        want_test = split == "test"
        problems, attempts = [], 0
        while len(problems) < n:
            attempts += 1
            if attempts > 1000 * n + 10_000:  # only reachable if a split were empty
                raise RuntimeError(
                    f"could not draw {n} {split} problems at difficulty {self.difficulty}"
                )
            a, b = rng.randrange(10**self.difficulty), rng.randrange(10**self.difficulty)
            if _in_test_split(f"{min(a, b)}+{max(a, b)}") == want_test:
                problems.append(Problem(prompt=f"{a}+{b}=", answer=str(a + b)))
        return problems

    def demonstration(self, problem: Problem, rng: random.Random | None = None) -> str:
        """Scratchpad completion for the supervised warm-start; wrong with probability
        demo_error_rate."""
        rng = rng or self.rng
        a_text, b_text = problem.prompt.rstrip("=").split("+")
        columns = self.difficulty
        a_digits = [int(c) for c in a_text.zfill(columns)[::-1]]  # least significant first
        b_digits = [int(c) for c in b_text.zfill(columns)[::-1]]

        error_column, error_kind = -1, None
        if rng.random() < self.demo_error_rate:
            # Which columns receive a carry is decided by the correct computation up to that point,
            # and the error is the first deviation, so this list is exact.
            carried, carry = [], 0
            for column in range(columns):
                if carry:
                    carried.append(column)
                carry = (a_digits[column] + b_digits[column] + carry) // 10
            if carried and rng.random() < 0.5:
                error_column, error_kind = rng.choice(carried), "dropped_carry"
            else:
                error_column, error_kind = rng.randrange(columns), "slip"

        steps, answer_digits, carry = [], [], 0
        for column in range(columns):
            a, b = a_digits[column], b_digits[column]
            carry_in = 0 if (column == error_column and error_kind == "dropped_carry") else carry
            column_sum = a + b + carry_in
            if column == error_column and error_kind == "slip":
                wrong_units = rng.choice([d for d in range(10) if d != column_sum % 10])
                column_sum = 10 * (column_sum // 10) + wrong_units
            steps.append(f"{a}+{b}+{carry_in}={column_sum:02d}")
            answer_digits.append(column_sum % 10)
            carry = column_sum // 10
        answer = "".join(str(d) for d in ([carry] + answer_digits[::-1])).lstrip("0") or "0"
        return ";".join(steps) + ">" + answer

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 iff the digits after the last '>' equal the sum (whitespace, leading zeros aside)."""
        if not isinstance(completion, str):
            return 0.0
        _, separator, claimed = completion.rpartition(">")
        claimed = claimed.strip()
        # No int(): CPython refuses to parse over 4300 digits, and model output can be that long.
        if not separator or not claimed or not (claimed.isascii() and claimed.isdigit()):
            return 0.0
        return 1.0 if (claimed.lstrip("0") or "0") == problem.answer else 0.0


# -----------------------------------------------------------------------------
# GSM8K-style math through `datasets`

GSM8K_INSTRUCTION = (
    'Solve the problem step by step. '
    'Finish with the final answer on its own line as "#### <number>".'
)

# ASCII digits only: \d would accept any script
_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")

# longer digit runs are not answers (and would overflow Decimal's exponent range)
_MAX_NUMBER_CHARS = 100


def _to_decimal(number_text: str) -> Decimal | None:
    if len(number_text) > _MAX_NUMBER_CHARS:
        return None
    try:
        return Decimal(number_text.replace(",", ""))
    except InvalidOperation:
        return None


def _boxed_content(text: str) -> str | None:
    """Text inside the last \\boxed{...}, braces balanced; None if absent or unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


def extract_answer(text: str) -> Decimal | None:
    """The numeric answer of a completion: the first number after the last "####" if that marker is
    present, else the last number in the last \\boxed{...}, else the last number in the text."""
    if not isinstance(text, str):
        return None
    if "####" in text:
        match = _NUMBER.search(text.rpartition("####")[2])
        return _to_decimal(match.group()) if match else None
    boxed = _boxed_content(text)
    scope = boxed if boxed is not None else text
    last = None
    for last in _NUMBER.finditer(scope):
        pass
    return _to_decimal(last.group()) if last else None


class GSM8KTask:
    """Grade-school math from the hub or a local file (module docstring); loads on creation."""

    name = "gsm8k"
    tokenizer = None  # a real model brings its own tokenizer

    def __init__(
        self,
        source: str = "openai/gsm8k",
        config: str | None = "main",
        test_source: str | None = None,
        seed: int = 0,
    ):
        self.rng = random.Random(seed)  # used only when a caller passes no rng
        rows = _load_rows(source, config, "train")
        if test_source is not None:
            train_rows, test_rows = rows, _load_rows(test_source, config, "test")
        elif _is_local(source):
            train_rows = [row for row in rows if not _in_test_split(row["question"])]
            test_rows = [row for row in rows if _in_test_split(row["question"])]
        else:
            train_rows, test_rows = rows, _load_rows(source, config, "test")
        self.problems = {
            "train": [_gsm8k_problem(row) for row in train_rows],
            "test": [_gsm8k_problem(row) for row in test_rows],
        }

    def sample(self, n: int, split: str, rng: random.Random | None = None) -> list[Problem]:
        """n problems of the split, without replacement when the split has at least n, else with."""
        if split not in self.problems:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        pool = self.problems[split]
        rng = rng or self.rng
        if not pool:
            raise ValueError(f"the {split} split is empty")
        return rng.sample(pool, n) if n <= len(pool) else rng.choices(pool, k=n)

    def demonstration(self, problem: Problem, rng: random.Random | None = None) -> str:
        """The dataset's own solution (calculator annotations removed), ending in
        "#### <answer>"."""
        return problem.solution

    def reward(self, problem: Problem, completion: str) -> float:
        claimed, expected = extract_answer(completion), _to_decimal(problem.answer)
        if claimed is None or expected is None:
            return 0.0
        return 1.0 if abs(claimed - expected) <= Decimal("1e-6") else 0.0


class HFTokenizer:
    """A Hugging Face tokenizer with CharTokenizer's interface (EOS pads when there is no pad
    token)."""

    def __init__(self, tokenizer):
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "the checkpoint's tokenizer has no EOS token, so completions could never end"
            )
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)
        self.pad_id = tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]  # up to the first EOS, as CharTokenizer decodes
        return self.tokenizer.decode(ids, skip_special_tokens=True)


_LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _is_local(source: str) -> bool:
    """A local file is named by its extension; anything else goes to `datasets.load_dataset` as is
    (a hub name, or a local dataset directory)."""
    return os.path.splitext(source)[1].lower() in _LOCAL_FORMATS


def _load_rows(source: str, config: str | None, split: str) -> list[dict]:
    import datasets  # imported here: the synthetic task must not need it

    if _is_local(source):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"no such dataset file: {source}")
        builder = _LOCAL_FORMATS[os.path.splitext(source)[1].lower()]
        dataset = datasets.load_dataset(builder, data_files=source, split="train")
    else:
        dataset = datasets.load_dataset(source, config, split=split)
    missing = {"question", "answer"} - set(dataset.column_names)
    if missing:
        raise ValueError(
            f"{source} lacks the field(s) {sorted(missing)}; has {dataset.column_names}"
        )
    return [{"question": row["question"], "answer": row["answer"]} for row in dataset]


_CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")  # GSM8K's "<<48/2=24>>" tool traces


def _gsm8k_problem(row: dict) -> Problem:
    solution = _CALCULATOR_ANNOTATION.sub("", row["answer"]).strip()
    reference = extract_answer(solution)
    if "####" not in solution or reference is None:
        raise ValueError(
            f"reference solution has no '#### <number>' answer: {row['answer'][-80:]!r}"
        )
    return Problem(
        prompt=f"{row['question'].strip()}\n\n{GSM8K_INSTRUCTION}",
        answer=_canonical(reference),
        solution=solution,
    )


def _canonical(number: Decimal) -> str:
    text = format(number, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


# -----------------------------------------------------------------------------

TASKS = {"arith": ArithmeticTask, "gsm8k": GSM8KTask}


def make_task(name: str, **kwargs):
    """The task `name` ("arith" or "gsm8k"), built with its constructor's keyword arguments."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {sorted(TASKS)}")
    return TASKS[name](**kwargs)
