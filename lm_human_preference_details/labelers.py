"""Programmatic labelers: stand-ins for OAI's human labelers that write the same label files.

A labeler scores (query texts, response texts) -> floats, higher is better; for a best-of-N
label the best-scoring response wins. OAI's online-label path asked humans the same question.
"""

import functools
import importlib
from collections.abc import Callable, Sequence

import torch

from .cli import UserError

Labeler = Callable[[Sequence[str], Sequence[str]], Sequence[float]]


@functools.cache
def _vader():
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError as e:
        raise RuntimeError("the vader labeler needs the package: pip install vaderSentiment") from e
    return SentimentIntensityAnalyzer()


def vader(queries: Sequence[str], responses: Sequence[str]) -> list[float]:
    """Sentiment of the response alone: VADER's compound score in [-1, 1]."""
    analyzer = _vader()
    return [analyzer.polarity_scores(r)["compound"] for r in responses]


def vowels(queries: Sequence[str], responses: Sequence[str]) -> list[float]:
    """Fraction of the response's characters that are vowels: a taste the tiny model can learn."""
    return [sum(c in "aeiou" for c in r.lower()) / max(len(r), 1) for r in responses]


BUILTIN: dict[str, Labeler] = {"vader": vader, "vowels": vowels}


def load_labeler(spec: str) -> Labeler:
    """`vader`, `vowels`, or `package.module:function`."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        raise UserError(f"labeler {spec!r} is neither {' nor '.join(BUILTIN)} nor of the form module:function")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as e:
        raise UserError(f"labeler {spec!r} cannot be loaded: {e}") from e
    if not callable(function):
        raise UserError(f"labeler {spec!r} is not callable")
    return function


def pick_best(scores: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, K) scores -> (B,) index of the best response, ties broken at random."""
    noise = torch.rand(scores.shape, generator=generator)
    top = scores == scores.max(dim=1, keepdim=True).values
    return torch.where(top, noise, torch.full_like(noise, -1.0)).argmax(dim=1)
