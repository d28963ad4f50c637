"""Fixed-length categorical sampling.

# OAI: lm_human_preferences/language/sample.py#L43
# OAI: lm_human_preferences/policy.py#L103
"""

import pytest
import torch

from lm_human_preference_details.models import PolicyAndValue, load_causal_lm, logprobs_of
from lm_human_preference_details.sampling import sample_responses
from lm_human_preference_details.text import left_pad, load_tokenizer

R = 12


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def lm():
    return load_causal_lm("tiny")


def queries(tokenizer, width, texts=("hello there.", "a", "what a day it is", "ok, fine!")):
    pad = tokenizer.oai_pad_token_id
    rows = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return torch.tensor([[pad] * (width - len(r)) + r for r in rows])


def recomputed_logprobs(lm, queries, responses, pad_id, temperature):
    """Logprobs of the responses from one forward pass over query + response (no KV cache)."""
    with torch.no_grad():
        logits, _ = PolicyAndValue(lm)(torch.cat([queries, responses], dim=1), pad_id)
    q = queries.shape[1]
    return logprobs_of(logits[:, q - 1 : -1], responses, temperature)


def sample(lm, q, pad_id, temperature=0.7, seed=0, length=R):
    return sample_responses(lm, q, pad_id, length, temperature, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_logprobs_match_full_forward(lm, tokenizer, temperature):
    pad = tokenizer.oai_pad_token_id
    q = queries(tokenizer, 20)
    responses, logprobs = sample(lm, q, pad, temperature)
    assert responses.shape == (4, R) and logprobs.shape == (4, R)
    assert responses.dtype == torch.long
    assert ((responses >= 0) & (responses < lm.config.vocab_size)).all()
    expected = recomputed_logprobs(lm, q, responses, pad, temperature)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)
    # and the temperature matters: at another temperature the logprobs differ
    assert (recomputed_logprobs(lm, q, responses, pad, temperature * 2) - logprobs).abs().max() > 1e-2


def test_same_seed_same_samples(lm, tokenizer):
    pad = tokenizer.oai_pad_token_id
    q = queries(tokenizer, 20)
    a, lp_a = sample(lm, q, pad, seed=3)
    b, lp_b = sample(lm, q, pad, seed=3)
    c, _ = sample(lm, q, pad, seed=4)
    assert torch.equal(a, b) and torch.equal(lp_a, lp_b)
    assert not torch.equal(a, c)


def test_left_padding_does_not_change_samples(lm, tokenizer):
    """Same generator seed, different amounts of left padding: the same distributions, so the same draws."""
    pad = tokenizer.oai_pad_token_id
    a, lp_a = sample(lm, queries(tokenizer, 18), pad, seed=5)
    b, lp_b = sample(lm, queries(tokenizer, 40), pad, seed=5)
    torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=1e-5)
    assert torch.equal(a, b)


def test_fixed_length_even_when_eos_dominates(lm, tokenizer):
    """Sampling never stops at EOS: exactly R tokens, EOS mid-response, real tokens after it."""
    eos, pad = tokenizer.eos_token_id, tokenizer.oai_pad_token_id

    def prefer_eos(module, args, output):
        output = output.clone()
        output[..., eos] += 6.0  # EOS most of the draws at temperature 1
        return output

    handle = lm.get_output_embeddings().register_forward_hook(prefer_eos)
    try:
        q = queries(tokenizer, 20, texts=["hello there."] * 16)
        responses, logprobs = sample(lm, q, pad, temperature=1.0, seed=6, length=24)
        expected = recomputed_logprobs(lm, q, responses, pad, 1.0)  # the hook applies here too
    finally:
        handle.remove()
    assert responses.shape == (16, 24)
    is_eos = responses == eos
    assert is_eos.float().mean() > 0.5  # EOS is by far the most likely token
    assert is_eos[:, :-1].any()  # EOS mid-response
    after_eos = torch.cumsum(is_eos.long(), dim=1) > 0
    assert (after_eos & ~is_eos).any()  # sampling went on after an EOS with other tokens
    assert not (responses == pad).any()
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)
    assert logprobs[is_eos].mean() > -0.5  # the hook did bias the sampled distribution


def test_never_samples_beyond_the_tokenizer_vocab():
    """A model whose embedding table has extra rows (padded vocab) must not sample them.

    # OAI: lm_human_preferences/policy.py#L59
    """
    tokenizer = load_tokenizer("tiny")
    pad_id = tokenizer.oai_pad_token_id
    lm = load_causal_lm("tiny")
    lm.resize_token_embeddings(len(tokenizer) + 8)

    def favour_extra_rows(module, inputs, logits):  # the extra rows would win every draw
        return torch.cat([logits[..., : len(tokenizer)], logits[..., len(tokenizer) :] + 100.0], dim=-1)

    lm.get_output_embeddings().register_forward_hook(favour_extra_rows)
    queries = left_pad([[1, 2, 3]] * 8, 4, pad_id)
    unsliced, _ = sample_responses(lm, queries, pad_id, 6, 1.0)
    assert (unsliced >= len(tokenizer)).all()  # the hazard is real
    responses, _ = sample_responses(lm, queries, pad_id, 6, 1.0, vocab_size=len(tokenizer))
    assert (responses < len(tokenizer)).all()
    logits, _ = PolicyAndValue(lm, vocab_size=len(tokenizer))(torch.cat([queries, responses], 1), pad_id)
    assert logits.shape[-1] == len(tokenizer)
