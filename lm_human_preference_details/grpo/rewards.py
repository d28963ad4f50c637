"""Verifiable rewards and the problems they score.

The math reward follows PipelineRL: the content of the last `\\boxed{...}` of a completion is checked
against the ground truth with `math_verify`; 1.0 when they are equal, 0.0 otherwise.
Problems come from offline generators (arithmetic) or from GSM8K, MATH-500 and Open-Reasoner-Zero
data, on the hub or in local JSON / JSON-lines files.
"""

import functools
import itertools
import json
import math
import operator
import os
import random
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lm_human_preference_details.assets import tiny_math_prompt
from lm_human_preference_details.cli import UserError

if TYPE_CHECKING:
    from lm_human_preference_details.grpo.config import GRPOArgs

BOXED_INSTRUCTION = " Please reason step by step, and put your final answer within \\boxed{}."
"""Appended to every GSM8K, MATH-500 and Open-Reasoner-Zero question (the prompt of DeepSeek-R1 and PipelineRL)."""

VERIFY_TIMEOUT_S = 5
"""math_verify's limit on each parse and each comparison, applied only on the main thread (see math_reward)."""

HUB_DATASETS = {"gsm8k": ("openai/gsm8k", "main"), "math500": ("HuggingFaceH4/MATH-500", None)}
ORZ_DATA_URL = "https://github.com/Open-Reasoner-Zero/Open-Reasoner-Zero/tree/main/data"
ORZ_ITEM = '[{"from": "human", "value": QUESTION}, {"from": "assistant", "ground_truth": {"value": ANSWER}}]'
FORMATS = "GSM8K, MATH-500, Open-Reasoner-Zero or prompt/answer records"
HELD_OUT = "held-out"
"""`--eval-problems`' name for the task's problems that the training stream never shows (`held_out_problems`)"""

_BOX_START = re.compile(r"\\(?:boxed|fbox)\{")
_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
INTEGER = re.compile(r"[-+]?[0-9]+")


@dataclass(frozen=True)
class Problem:
    """One task for the policy: the prompt it reads and the ground truth its boxed answer is checked against."""

    prompt: str
    answer: str  # the ground truth, e.g. "42" or "\\frac{1}{2}"
    id: str


# ----------------------------------------------------------------------------- rewards
def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, nested braces included.

    None when there is no box, or when the last one is never closed (a truncated completion does not get
    credit for an earlier box). Escaped braces `\\{ \\}` (LaTeX sets) do not count as nesting.
    """
    starts = list(_BOX_START.finditer(text))
    if not starts:
        return None
    begin = starts[-1].end()
    depth, i = 1, begin
    while i < len(text):
        if text[i] == "\\":
            i += 2  # skip the escaped character, so `\{` and `\}` leave the depth alone
            continue
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
        i += 1
    return None


def math_reward(completion: str, answer: str, only_integers: bool = False) -> float:
    """1.0 when the last `\\boxed{}` of `completion` equals `answer` by math_verify, else 0.0. Never raises.
    `only_integers` (`--integer-answers`): a box that is not a plain integer scores 0.0 without math_verify.

    Both sides are parsed in `\\boxed{...}` form: as bare strings math_verify's LaTeX extractor finds
    nothing in `\\frac12` or `\\dfrac{1}{2}`, and `1{,}000` reads as 1.

    math_verify bounds each parse and comparison with `signal.alarm`, which works only on the main thread:
    elsewhere it raises ValueError("signal only works in main thread ..."), so the timeout is passed as
    None there. Without it a pathological answer such as `9^{9^{9^{9}}}` makes sympy compare forever; to
    bound it from an asyncio loop or worker threads, run math_reward in a ProcessPoolExecutor, whose
    workers call it on their own main thread where the timeout works (PipelineRL's verifier does this).
    """
    quick = integer_reward(completion, answer, only_integers)
    if quick is not None:
        return quick
    timeout = VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    return _verify_boxed(last_boxed(completion), answer, timeout)


@functools.lru_cache(maxsize=2**16)
def _verify_boxed(boxed: str, answer: str, timeout: float | None) -> float:
    """math_verify's judgement of a box against the answer, remembered: a policy repeats its answers
    (a run sends the same few boxes over and over) and each judgement costs a sympy parse and comparison."""
    import math_verify  # sympy's seconds of import only where a box needs it: the launcher checks problems without

    try:
        gold = math_verify.parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
        pred = math_verify.parse(f"\\boxed{{{boxed}}}", parsing_timeout=timeout)
        return float(math_verify.verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # sympy and the LaTeX parser raise many kinds; any of them means "not verified"
        return 0.0


def math_rewards(completions: list[str], answer: str) -> list[float]:
    """`math_reward` of each completion: what a verifier worker process runs (this module imports no torch,
    so such a worker starts in a fraction of a second)."""
    return [math_reward(c, answer) for c in completions]


def integer_reward(completion: str, answer: str, only_integers: bool = False) -> float | None:
    """`math_reward` without math_verify where that is certain: no box (0.0), or a box and an answer
    that are both plain integers, signed or not (compared as integers, as math_verify would, without
    sympy in the verifier process: a policy that boxes `+2` would otherwise send every such group there).
    None when math_verify must decide; 0.0 instead with `only_integers` (`--integer-answers`)."""
    boxed = last_boxed(completion)
    if boxed is None:
        return 0.0
    if INTEGER.fullmatch(boxed.strip()) and INTEGER.fullmatch(answer.strip()):
        return float(_canonical_integer(boxed) == _canonical_integer(answer))
    return 0.0 if only_integers else None


def _canonical_integer(text: str) -> str:
    """A plain integer's digits without sign or leading zeros, `-` in front if negative: compared as text,
    since `int()` refuses more than 4300 digits (a policy can box that many)."""
    text = text.strip()
    digits = text.lstrip("+-").lstrip("0") or "0"
    return "-" + digits if text.startswith("-") and digits != "0" else digits


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k estimated without bias from `n` samples of which `c` are right (Chen et al. 2021, arXiv 2107.03374,
    eq. 1): 1 - C(n-c, k) / C(n, k), the chance that k samples drawn from the n without replacement hold a right
    one; equivalent to counting the k-subsets of the n that hold one."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# ----------------------------------------------------------------------------- problems
def load_task_problems(args: "GRPOArgs") -> list[Problem]:
    """The run's problems (`--problems`, `--num-problems`, `--arith-*`) in a seeded order (the actor cycles
    through them)."""
    task = args.task
    if task.problems == "tiny-sums":
        problems = tiny_sums()
    elif task.problems == "arith":
        problems = arithmetic_problems(
            count=task.num_problems or 1000, seed=args.seed, digits=task.arith_digits, template=task.arith_template
        )
    else:
        problems = load_problems(task.problems, limit=task.num_problems or None)
    if task.num_problems:
        problems = problems[: task.num_problems]
    if not problems:
        raise UserError(f"--problems {task.problems}: no problems")
    random.Random(args.seed).shuffle(problems)
    return problems


def tiny_sums() -> list[Problem]:
    """All 25 sums a+b of digits 0-4 in the `tiny-math` model's format (answers 0-8)."""
    return [
        Problem(prompt=tiny_math_prompt(a, b), answer=str(a + b), id=f"sum-{a}-{b}") for a in range(5) for b in range(5)
    ]


def arithmetic_problems(
    count: int,
    seed: int,
    digits: int = 2,
    operators: str = "+-*",
    template: str = "What is {expression}? Put the final answer in \\boxed{{}}.",
) -> list[Problem]:
    """`count` problems `a<op>b` with operands of exactly `digits` digits (0-9 for one digit), the same for a seed."""
    if digits < 1:
        raise UserError(f"digits={digits}: must be at least 1")
    if not operators or set(operators) - set(_OPERATORS):
        raise UserError(f"operators={operators!r}: use one or more of {''.join(_OPERATORS)} (answers must be integers)")
    low, high = operand_range(digits)
    rng = random.Random(seed)
    problems = []
    for i in range(count):
        a, op, b = rng.randint(low, high), rng.choice(operators), rng.randint(low, high)
        problems.append(arithmetic_problem(a, op, b, template, id=f"arith-{seed}-{i}"))
    return problems


def arithmetic_problem(a: int, op: str, b: int, template: str, id: str) -> Problem:
    """`a<op>b` asked through `template` (its `{expression}`), with its integer answer."""
    return Problem(prompt=template.format(expression=f"{a}{op}{b}"), answer=str(_OPERATORS[op](a, b)), id=id)


def operand_range(digits: int) -> tuple[int, int]:
    """The smallest and largest operand of exactly `digits` digits (0-9 for one)."""
    return (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1


def problem_family(args: "GRPOArgs") -> list[Problem]:
    """Every problem the task's generator can draw (`tiny-sums`: its 25; `arith`: every `a<op>b` of its digits, up
    to 2), to hold out the ones a run never shows; a UserError for a fixed set (the hub's, a file)."""
    task = args.task
    if task.problems == "tiny-sums":
        return tiny_sums()
    if task.problems == "arith":
        if task.arith_digits > 2:
            raise UserError(
                f"--arith-digits {task.arith_digits}: its {3 * (9 * 10 ** (task.arith_digits - 1)) ** 2:,} problems "
                "are too many to list for held-out checks; use 1 or 2"
            )
        low, high = operand_range(task.arith_digits)
        return [
            arithmetic_problem(a, op, b, task.arith_template, id=f"arith-{a}{op}{b}")
            for op in "+-*"
            for a in range(low, high + 1)
            for b in range(low, high + 1)
        ]
    raise UserError(
        f"--problems {task.problems}: a fixed set, with no problems beyond the run's to hold out for "
        f"--eval-problems {HELD_OUT}; use --problems arith or tiny-sums, or pass --eval-problems FILE"
    )


def held_out_problems(args: "GRPOArgs") -> list[Problem]:
    """The problems of the task's family that the training stream never shows (`problem_family` less
    `load_task_problems`), in a seeded order; a UserError when none is left."""
    family = problem_family(args)
    seen = {p.prompt for p in load_task_problems(args)}
    unseen = [p for p in family if p.prompt not in seen]
    if not unseen:
        raise UserError(
            f"--num-problems {args.task.num_problems}: the training stream shows all {len(family)} problems of "
            f"--problems {args.task.problems}, none is left to hold out; pass a --num-problems below {len(family)}, "
            "or --eval-problems FILE"
        )
    random.Random(args.seed + 1).shuffle(unseen)
    return unseen


def eval_problems(args: "GRPOArgs") -> list[Problem]:
    """The problems `--eval-every` evaluates on: `--eval-problems held-out` (`held_out_problems`), or a file or hub
    set read as `--problems` is; the first `--eval-num-problems` of them (0: all)."""
    source, limit = args.evaluation.eval_problems, args.evaluation.eval_num_problems or None
    if source == HELD_OUT:
        problems = held_out_problems(args)
    elif os.path.isfile(source) or source in HUB_DATASETS:
        problems = load_problems(source)
    else:
        raise UserError(
            f"--eval-problems {source}: no such file; pass `{HELD_OUT}` (the task's problems the training stream "
            f"never shows), {' or '.join(HUB_DATASETS)}, or a .json/.jsonl file of {FORMATS}"
        )
    if not problems:
        raise UserError(f"--eval-problems {source}: no problems")
    return problems[:limit]


def load_problems(source: str, split: str = "test", limit: int | None = None) -> list[Problem]:
    """Problems from `gsm8k` or `math500` on the hub (`split`), or from a local JSON / JSON-lines file.

    A file holds a list of records (or one per line) in any of these formats, told apart by their fields:
    GSM8K `{question, answer: "... #### 42"}`, MATH-500 `{problem, answer}`, Open-Reasoner-Zero
    `[{from: human, value}, {from: assistant, ground_truth: {value}}]`, or `{prompt, answer}` whose
    prompt is used as is. The others get BOXED_INSTRUCTION after the question. A record's `id` is kept,
    else the id is `<file stem>-<index>` (`<source>-<split>-<index>` on the hub). `split` applies to the hub only;
    Open-Reasoner-Zero is not on the hub under a fixed name, so `orz` only says where to download it.
    """
    if os.path.isfile(source):
        records, where = _read_records(source), f"problems file {source}"
        prefix = os.path.splitext(os.path.basename(source))[0]
    elif source in HUB_DATASETS:
        records, where, prefix = _hub_records(source, split), source, f"{source}-{split}"
    elif source == "orz":
        raise UserError(
            f"source=orz: Open-Reasoner-Zero data is not on the hub; download a JSON file from {ORZ_DATA_URL} and "
            "pass its path"
        )
    else:
        raise UserError(
            f"source={source!r}: no such file; choose {' or '.join(HUB_DATASETS)}, or the path of a .json/.jsonl "
            f"file of {FORMATS}"
        )
    return [
        _problem(record, f"{where} record {i}", f"{prefix}-{i}")
        for i, record in enumerate(itertools.islice(records, limit))
    ]


def _read_records(path: str) -> list:
    """The records of a `.jsonl` file, or of a JSON list (or JSON lines: `datasets.Dataset.to_json` writes them
    even to `.json`)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not path.endswith(".jsonl"):
        try:
            records = json.loads(text)
        except json.JSONDecodeError:
            pass
        else:
            if not isinstance(records, list):
                raise UserError(f"problems file {path}: expected a JSON list of {FORMATS}, or one record per line")
            return records
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            records += [json.loads(line)] if line.strip() else []
        except json.JSONDecodeError as e:
            raise UserError(f"problems file {path}: neither a JSON list nor JSON lines (line {n}: {e})") from e
    return records


def _hub_records(name: str, split: str) -> Iterable[dict]:
    """The rows of a hub dataset, as dicts."""
    import datasets

    path, config = HUB_DATASETS[name]
    try:
        return datasets.load_dataset(path, config, split=split)
    except Exception as e:  # offline, unknown split, hub errors: all mean the same to the user
        raise UserError(
            f"source={name}: cannot load {path} split {split!r} from the hub ({e}); pass a local .json/.jsonl file "
            "instead"
        ) from e


def _problem(record, where: str, default_id: str) -> Problem:
    """One record in any of the accepted formats; `where` names it in errors."""
    if isinstance(record, list):  # Open-Reasoner-Zero: [human turn, assistant turn with the ground truth]
        question = _orz_field(record, (0, "value"), where)
        answer = _orz_field(record, (1, "ground_truth", "value"), where)
        return Problem(question.strip() + BOXED_INSTRUCTION, answer, default_id)
    if not isinstance(record, dict):
        raise UserError(
            f"{where}: expected an object or an Open-Reasoner-Zero list ({FORMATS}), got {type(record).__name__}"
        )
    problem_id = str(record.get("id", default_id))
    if "answer" not in record:
        raise UserError(f"{where}: no field 'answer' (expected {FORMATS})")
    answer = _text(record["answer"], "answer", where)
    if "prompt" in record:
        return Problem(_text(record["prompt"], "prompt", where), answer, problem_id)
    if "question" in record:  # GSM8K: the gold number follows the last #### (when there is one), with thousands commas
        return Problem(
            _text(record["question"], "question", where).strip() + BOXED_INSTRUCTION,
            answer.split("####")[-1].replace(",", "").strip(),
            problem_id,
        )
    if "problem" in record:
        return Problem(_text(record["problem"], "problem", where).strip() + BOXED_INSTRUCTION, answer, problem_id)
    raise UserError(f"{where}: no field 'question', 'problem' or 'prompt' (expected {FORMATS})")


def _orz_field(item: list, path: tuple, where: str) -> str:
    """`item[0]["value"]` for path (0, "value"), with an error naming the path when it is missing."""
    name = f"[{path[0]}]." + ".".join(path[1:])
    value = item
    for key in path:
        try:
            value = value[key]
        except (IndexError, KeyError, TypeError):
            raise UserError(f"{where}: no field {name!r} (an Open-Reasoner-Zero item is {ORZ_ITEM})") from None
    return _text(value, name, where)


def _text(value, field: str, where: str) -> str:
    """A field that must be a non-empty string; numbers (JSON answers like 42) become strings."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
        raise UserError(f"{where}: field {field!r} must be a non-empty string, got {value!r}")
    return str(value)
