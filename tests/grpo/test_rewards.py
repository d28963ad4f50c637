"""Verifiable rewards (math_verify on the last \\boxed{}), arithmetic problems and problem loaders, all offline."""

import faulthandler
import itertools
import json
import re
import threading
import time

import pytest

from lm_human_preference_details.cli import UserError
from lm_human_preference_details.grpo import rewards
from lm_human_preference_details.grpo.config import get_preset
from lm_human_preference_details.grpo.rewards import (
    BOXED_INSTRUCTION,
    Problem,
    arithmetic_problems,
    eval_problems,
    held_out_problems,
    last_boxed,
    load_problems,
    load_task_problems,
    math_reward,
    pass_at_k,
    problem_family,
    tiny_sums,
)
from tests.grpo.args import grpo_args


# ----------------------------------------------------------------------------- last_boxed
@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}} done", "\\frac{\\sqrt{3}}{2}"),
        ("first \\boxed{1}, then \\boxed{2}", "2"),
        ("\\fbox{7}", "7"),
        ("\\boxed{3} and \\fbox{4}", "4"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces are a set, not nesting
        ("\\boxed{\\}}", "\\}"),
        ("\\boxed{}", ""),
    ],
)
def test_last_boxed_takes_the_last_box_with_nested_braces(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "text",
    ["no box here", "", "\\boxed{1} then \\boxed{\\frac{1}{2}", "\\boxed{2", "\\boxed 5", "\\boxed{\\frac{1}{2}"],
)
def test_last_boxed_is_none_without_a_closed_last_box(text):
    assert last_boxed(text) is None


# ----------------------------------------------------------------------------- math_reward
@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("The answer is \\boxed{42}.", "42", 1.0),
        ("The answer is \\boxed{41}.", "42", 0.0),
        ("\\boxed{41} no wait, \\boxed{42}", "42", 1.0),
        ("\\boxed{42} no wait, \\boxed{41}", "42", 0.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac12}", "0.5", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{7.0}", "7", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{1{,}000}", "1000", 1.0),
        ("\\boxed{1,2}", "12", 0.0),
        ("\\boxed{x=3}", "3", 1.0),
        ("\\boxed{\\$18.00}", "18", 1.0),
        ("\\boxed{-22}", "-22", 1.0),
        ("\\boxed{22}", "-22", 0.0),
        ("\\fbox{\\{2,1\\}}", "\\{1,2\\}", 1.0),
    ],
)
def test_math_reward_checks_the_last_box_by_value(completion, answer, reward):
    assert math_reward(completion, answer) == reward


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("42", "42"),  # no box: the format is part of the task
        ("\\boxed{42", "42"),
        ("\\boxed{}", "42"),
        ("\\boxed{\\frac{}{}}", "42"),
        ("\\boxed{\\left(}", "42"),
        ("\\boxed{)(*&^%$#@!}", "42"),
        ("\\boxed{\\sqrt}", "42"),
        ("\\boxed{42}", "\\frac{"),  # a broken ground truth scores 0 too
        ("\\boxed{42}", ""),
        ("\\boxed{\x00\ufffd}", "42"),
    ],
)
def test_math_reward_is_zero_on_garbage(completion, answer):
    assert math_reward(completion, answer) == 0.0


def test_math_reward_in_a_worker_thread():
    # math_verify's signal-based timeout would raise there; math_reward must pass None and still verify
    cases = [("\\boxed{0.5}", "\\frac{1}{2}"), ("\\boxed{42}", "42"), ("\\boxed{41}", "42")]
    results = []
    thread = threading.Thread(target=lambda: results.extend(math_reward(c, a) for c, a in cases))
    thread.start()
    thread.join(timeout=60)
    assert results == [1.0, 1.0, 0.0]


def test_math_reward_remembers_judgements():
    before = rewards._verify_boxed.cache_info()
    assert [math_reward("so \\boxed{3+4}", "7") for _ in range(3)] == [1.0] * 3
    after = rewards._verify_boxed.cache_info()
    assert after.hits - before.hits >= 2 and after.misses - before.misses <= 1
    assert math_reward("so \\boxed{3+4}", "8") == 0.0  # judged against its own answer


def test_math_reward_times_out_on_a_power_tower_in_the_main_thread(monkeypatch):
    monkeypatch.setattr(rewards, "VERIFY_TIMEOUT_S", 1)
    faulthandler.dump_traceback_later(60, exit=True)  # without the timeout sympy never returns: end the run, loudly
    try:
        start = time.monotonic()
        assert math_reward("\\boxed{9^{9^{9^{9}}}}", "42") == 0.0
        assert time.monotonic() - start < 30
    finally:
        faulthandler.cancel_dump_traceback_later()


# ----------------------------------------------------------------------------- arithmetic
EXPRESSION = re.compile(r"What is (\d+)([-+*])(\d+)\? Put the final answer in \\boxed\{\}\.")


def test_arithmetic_problems_are_deterministic_per_seed():
    assert arithmetic_problems(50, seed=3) == arithmetic_problems(50, seed=3)
    assert arithmetic_problems(50, seed=3) != arithmetic_problems(50, seed=4)
    assert [p.id for p in arithmetic_problems(3, seed=3)] == ["arith-3-0", "arith-3-1", "arith-3-2"]


@pytest.mark.parametrize("digits", [1, 2, 3])
def test_arithmetic_problems_have_correct_answers_and_exact_digits(digits):
    problems = arithmetic_problems(300, seed=0, digits=digits)
    operands, operators = [], set()
    for problem in problems:
        a, op, b = EXPRESSION.fullmatch(problem.prompt).groups()
        assert problem.answer == str(eval(f"{a}{op}{b}"))
        operands += [a, b]
        operators.add(op)
    assert {len(x) for x in operands} == {digits}
    assert all(x == "0" or not x.startswith("0") for x in operands)
    assert operators == {"+", "-", "*"}
    if digits == 1:
        assert {int(x) for x in operands} == set(range(10))
    else:
        assert min(int(x) for x in operands) >= 10 ** (digits - 1)


def test_arithmetic_problems_honour_operators_and_template():
    problems = arithmetic_problems(20, seed=1, operators="-", template="Compute {expression}.")
    assert all(re.fullmatch(r"Compute \d\d-\d\d\.", p.prompt) for p in problems)
    assert any(p.answer.startswith("-") for p in problems)
    assert math_reward("\\boxed{" + problems[0].answer + "}", problems[0].answer) == 1.0


@pytest.mark.parametrize("kwargs", [dict(operators="/"), dict(operators=""), dict(digits=0)])
def test_arithmetic_problems_reject_bad_settings(kwargs):
    with pytest.raises(UserError):
        arithmetic_problems(5, seed=0, **kwargs)


# ----------------------------------------------------------------------------- loaders
def write_json(path, records):
    path.write_text(json.dumps(records))
    return str(path)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def orz_item(question, answer):
    return [{"from": "human", "value": question}, {"from": "assistant", "ground_truth": {"value": answer}}]


def test_load_gsm8k_records(tmp_path):
    records = [
        {"question": "How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 1,234"},
        {"question": "Q2 ", "answer": "#### 5"},
    ]
    problems = load_problems(write_json(tmp_path / "gsm.json", records))
    assert problems == [
        Problem(prompt="How many?" + BOXED_INSTRUCTION, answer="1234", id="gsm-0"),
        Problem(prompt="Q2" + BOXED_INSTRUCTION, answer="5", id="gsm-1"),
    ]


def test_load_math500_records(tmp_path):
    records = [{"problem": "Half of one?", "answer": "\\frac{1}{2}", "unique_id": "test/algebra/1.json"}]
    (problem,) = load_problems(write_jsonl(tmp_path / "math.jsonl", records))
    assert problem == Problem(prompt="Half of one?" + BOXED_INSTRUCTION, answer="\\frac{1}{2}", id="math-0")
    assert math_reward("so \\boxed{0.5}", problem.answer) == 1.0


def test_load_orz_records(tmp_path):
    problems = load_problems(write_json(tmp_path / "orz.json", [orz_item("1+1?", "2"), orz_item("2+2?", "4")]))
    assert problems == [
        Problem(prompt="1+1?" + BOXED_INSTRUCTION, answer="2", id="orz-0"),
        Problem(prompt="2+2?" + BOXED_INSTRUCTION, answer="4", id="orz-1"),
    ]


def test_load_prompt_answer_records_as_is(tmp_path):
    records = [{"prompt": "Say 42 in a box.", "answer": 42, "id": "p0"}, {"prompt": "Say x.", "answer": "x"}]
    problems = load_problems(write_jsonl(tmp_path / "mine.jsonl", records))
    assert problems == [
        Problem(prompt="Say 42 in a box.", answer="42", id="p0"),
        Problem(prompt="Say x.", answer="x", id="mine-1"),
    ]


def test_load_json_lines_in_a_json_file(tmp_path):
    # datasets.Dataset.to_json writes JSON lines whatever the extension
    path = write_jsonl(tmp_path / "exported.json", [{"problem": "P", "answer": "1"}, {"problem": "Q", "answer": "2"}])
    assert [p.answer for p in load_problems(path)] == ["1", "2"]


@pytest.mark.parametrize(
    "limit, expected", [(2, ["0", "1"]), (0, []), (None, ["0", "1", "2", "3", "4"]), (9, ["0", "1", "2", "3", "4"])]
)
def test_load_problems_honours_limit(tmp_path, limit, expected):
    path = write_json(tmp_path / "p.json", [{"prompt": f"p{i}", "answer": str(i)} for i in range(5)])
    assert [p.answer for p in load_problems(path, limit=limit)] == expected


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"question": "Q"}, "record 1: no field 'answer'"),
        ({"problem": "P", "answer": ""}, "record 1: field 'answer' must be a non-empty string"),
        ({"problem": "P", "answer": None}, "record 1: field 'answer' must be a non-empty string"),
        ({"problem": ["P"], "answer": "1"}, "record 1: field 'problem' must be a non-empty string"),
        ({"text": "P", "answer": "1"}, "record 1: no field 'question', 'problem' or 'prompt'"),
        ([{"from": "human", "value": "Q"}], "record 1: no field '[1].ground_truth.value'"),
        (
            [{"from": "human", "value": "Q"}, {"from": "assistant", "value": "2"}],
            "record 1: no field '[1].ground_truth.value'",
        ),
        ([{"from": "human"}, {"ground_truth": {"value": "2"}}], "record 1: no field '[0].value'"),
        (7, "record 1: expected an object"),
    ],
)
def test_bad_records_name_the_record_and_the_field(tmp_path, bad, message):
    path = write_json(tmp_path / "bad.json", [{"problem": "fine", "answer": "1"}, bad])
    with pytest.raises(UserError, match=re.escape(f"problems file {path} {message}")):
        load_problems(path)


def test_bad_files_are_user_errors(tmp_path):
    not_json = tmp_path / "broken.jsonl"
    not_json.write_text('{"prompt": "p", "answer": "1"}\n{"prompt": \n')
    with pytest.raises(UserError, match="line 2"):
        load_problems(str(not_json))
    with pytest.raises(UserError, match="expected a JSON list"):
        load_problems(write_json(tmp_path / "dict.json", {"data": [{"prompt": "p", "answer": "1"}]}))


@pytest.mark.parametrize(
    "source, message",
    [("gsm9k", "choose gsm8k or math500"), ("missing.jsonl", "no such file"), ("orz", "github.com/Open-Reasoner-Zero")],
)
def test_unknown_source_names_the_choices(source, message):
    with pytest.raises(UserError, match=re.escape(message)):
        load_problems(source)


def test_hub_sources_read_the_hub_dataset(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, config, split):
        calls.append((path, config, split))
        return [{"question": "Q", "answer": "so\n#### 2,000"}, {"question": "R", "answer": "#### 3"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_problems("gsm8k", split="train", limit=1) == [
        Problem(prompt="Q" + BOXED_INSTRUCTION, answer="2000", id="gsm8k-train-0")
    ]
    assert calls == [("openai/gsm8k", "main", "train")]


def test_hub_failures_are_user_errors(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("hub unreachable")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(
        UserError, match=r"source=math500: cannot load HuggingFaceH4/MATH-500 .*hub unreachable.*local \.json/\.jsonl"
    ):
        load_problems("math500")


def test_a_runs_problems_follow_its_settings_in_an_order_of_its_seed(tmp_path):
    tiny = grpo_args(get_preset("tiny"), num_problems=0)  # all 25 (the preset holds 5 out)
    assert sorted(p.id for p in tiny_sums()) == sorted(f"sum-{a}-{b}" for a in range(5) for b in range(5))
    assert all(int(p.id[4]) + int(p.id[6]) == int(p.answer) for p in tiny_sums())
    problems = load_task_problems(tiny)
    assert sorted(problems, key=lambda p: p.id) == sorted(tiny_sums(), key=lambda p: p.id)
    assert problems == load_task_problems(tiny) != tiny_sums()  # shuffled, the same way for a seed
    assert load_task_problems(grpo_args(tiny, seed=tiny.seed + 1)) != problems
    assert len(load_task_problems(grpo_args(tiny, num_problems=5))) == 5
    arith = load_task_problems(get_preset("arith"))
    assert len(arith) == 512 and arith[0].prompt.endswith("=\\boxed{") and arith[0].id.startswith("arith-")
    path = write_jsonl(tmp_path / "three.jsonl", [{"prompt": str(i), "answer": str(i)} for i in range(3)])
    assert len(load_task_problems(grpo_args(tiny, problems=path, num_problems=2))) == 2
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(UserError, match=f"--problems {empty}: no problems"):
        load_task_problems(grpo_args(tiny, problems=empty))


@pytest.mark.parametrize(
    "boxed, answer",
    [
        ("7", "7"),
        ("007", "7"),
        ("-3", "-3"),
        ("-0", "0"),
        ("12", "21"),
        ("7", "-7"),
        (" 42 ", "42"),
        ("+2", "2"),
        ("+0", "0"),
        ("+3", "2"),
        ("7", "+7"),
    ],
)
def test_the_integer_shortcut_agrees_with_math_verify(boxed, answer):
    """integer_reward skips sympy for plain integers; it must say what math_verify says."""
    import math_verify

    from lm_human_preference_details.grpo.rewards import integer_reward

    expected = float(
        math_verify.verify(math_verify.parse(f"\\boxed{{{answer}}}"), math_verify.parse(f"\\boxed{{{boxed}}}"))
    )
    assert integer_reward(f"so \\boxed{{{boxed}}}", answer) == expected
    assert integer_reward("no box at all", answer) == 0.0
    assert integer_reward("\\boxed{\\frac{1}{2}}", "0.5") is None  # math_verify decides


def test_only_integers_scores_a_boxed_expression_zero():
    """math_verify evaluates `\\boxed{6-1}` to 5, so a policy learns to box the question (seen with SmolLM2 on
    `arith-chat`); with only_integers (`--integer-answers`) only a boxed integer counts."""
    from lm_human_preference_details.grpo.rewards import integer_reward, math_reward

    assert math_reward("6-1 is \\boxed{6-1}", "5") == 1.0 and integer_reward("\\boxed{6-1}", "5") is None
    assert integer_reward("6-1 is \\boxed{6-1}", "5", only_integers=True) == 0.0
    assert integer_reward("6 - 1 = \\boxed{5}", "5", only_integers=True) == 1.0
    assert integer_reward("\\boxed{\\frac{1}{2}}", "0.5", only_integers=True) == 0.0


def test_an_integer_too_long_for_int_is_still_judged():
    """int() refuses strings of more than 4300 digits; a degenerate policy boxes that many."""
    from lm_human_preference_details.grpo.rewards import math_reward

    assert math_reward("\\boxed{" + "1" * 5000 + "}", "7") == 0.0
    assert math_reward("\\boxed{" + "0" * 5000 + "7}", "7") == 1.0


# ----------------------------------------------------------------------------- evaluation
def test_held_out_problems_are_those_the_training_stream_never_shows():
    tiny = get_preset("tiny")  # 20 of the 25 sums in the stream
    held_out = held_out_problems(tiny)
    assert len(held_out) == 5 and not {p.prompt for p in load_task_problems(tiny)} & {p.prompt for p in held_out}
    assert eval_problems(grpo_args(tiny, eval_every=20)) == held_out
    with pytest.raises(UserError, match="--num-problems 0: the training stream shows all 25 problems.*below 25"):
        grpo_args(tiny, num_problems=0, eval_every=20).check()


def test_the_arith_family_is_every_expression_of_its_digits_and_the_quickstart_evaluates_100_it_never_trains_on():
    args = get_preset("arith-chat")
    family = problem_family(args)
    assert len(family) == 3 * 10 * 10 and len({p.prompt for p in family}) == 300
    assert {p.answer for p in family if p.id == "arith-7*8"} == {"56"}
    evaluated = eval_problems(args)
    assert len(evaluated) == 100 and not {p.prompt for p in load_task_problems(args)} & {p.prompt for p in evaluated}


def test_eval_problems_are_read_from_a_file_as_problems_are(tmp_path):
    path = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(4)])
    args = grpo_args(get_preset("tiny"), eval_every=20, eval_problems=path, eval_num_problems=3)
    assert [p.answer for p in eval_problems(args)] == ["0", "1", "2"]
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(UserError, match=f"--eval-problems {re.escape(missing)}: no such file; pass `held-out`"):
        grpo_args(args, eval_problems=missing).check()
    with pytest.raises(UserError, match="--eval-samples must be between 1 and 512 .* got 0"):
        grpo_args(args, eval_samples=0).check()


def test_pass_at_k_is_the_share_of_k_samples_drawn_from_the_n_that_hold_a_right_one():
    """Chen et al.'s estimator against a direct count over every k-subset of known samples."""
    samples = [0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # n = 7, c = 2
    for k in range(1, len(samples) + 1):
        subsets = list(itertools.combinations(samples, k))
        direct = sum(1.0 in subset for subset in subsets) / len(subsets)
        assert pass_at_k(len(samples), 2, k) == pytest.approx(direct, abs=1e-12), k
    assert pass_at_k(7, 2, 1) == pytest.approx(2 / 7) and pass_at_k(7, 0, 3) == 0.0 and pass_at_k(7, 7, 1) == 1.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)
