"""Programmatic labelers and best-of-N picking."""

import os.path

import pytest
import torch

from lm_human_preference_details.cli import UserError
from lm_human_preference_details.labelers import BUILTIN, load_labeler, pick_best, vader, vowels


def test_vader_prefers_positive():
    scores = vader(
        ["q", "q", "q"],
        [
            "I love this, it is wonderful and makes me happy!",
            "the table is brown",
            "I hate this. It is awful and terrible.",
        ],
    )
    assert len(scores) == 3
    positive, neutral, negative = scores
    assert positive > 0.5 and negative < -0.5 and positive > neutral > negative
    assert all(-1 <= s <= 1 for s in scores)


def test_vader_scores_the_response_alone():
    assert vader(["I hate everything"], ["what a lovely day"]) == vader(["I love everything"], ["what a lovely day"])


def test_vowels():
    assert vowels(["", "", "", "", ""], ["aeiou", "xyz", "", "Hello", "A b"]) == [1.0, 0.0, 0.0, 2 / 5, 1 / 3]


def test_load_builtin():
    assert load_labeler("vader") is vader
    assert load_labeler("vowels") is vowels
    assert set(BUILTIN) == {"vader", "vowels"}


def test_load_module_function_stdlib():
    assert load_labeler("os.path:basename") is os.path.basename


def test_load_module_function_from_user_module(tmp_path, monkeypatch):
    (tmp_path / "my_lmhpd_labeler.py").write_text(
        "def length(queries, responses):\n    return [float(len(r)) for r in responses]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    labeler = load_labeler("my_lmhpd_labeler:length")
    assert labeler(["q", "q"], ["ab", "abcd"]) == [2.0, 4.0]


@pytest.mark.parametrize(
    "spec, words",
    [
        ("sentiment", "neither vader nor vowels nor of the form module:function"),
        ("os.path", "module:function"),
        (":basename", "module:function"),
        ("os.path:", "module:function"),
        ("", "module:function"),
        ("no_such_module_lmhpd:f", "cannot be loaded"),
        ("os.path:no_such_function", "cannot be loaded"),
        ("os:sep", "not callable"),
    ],
)
def test_bad_spec(spec, words):
    with pytest.raises(UserError, match=words) as info:
        load_labeler(spec)
    assert repr(spec) in str(info.value)


def test_pick_best_argmax():
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.2], [5.0, -1.0, 4.9, 0.0], [-3.0, -2.0, -1.0, -4.0]])
    for seed in range(5):
        assert pick_best(scores, torch.Generator().manual_seed(seed)).tolist() == [1, 0, 2]


def test_pick_best_breaks_ties_at_random_among_tied_only():
    n = 4000
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [-1.0, -5.0, -1.0, -1.0]]).repeat(n, 1)
    best = pick_best(scores, torch.Generator().manual_seed(0)).view(n, 3)
    for column, tied in enumerate([{1, 2}, {0, 1, 2, 3}, {0, 2, 3}]):
        picked = best[:, column]
        assert set(picked.tolist()) == tied
        counts = torch.bincount(picked, minlength=4).float()
        for i in tied:  # uniform among the tied ones: within ~6 sigma
            expected = n / len(tied)
            assert abs(counts[i] - expected) < 6 * (expected * (1 - 1 / len(tied))) ** 0.5
    same = pick_best(scores, torch.Generator().manual_seed(0)).view(n, 3)
    assert torch.equal(best, same)
