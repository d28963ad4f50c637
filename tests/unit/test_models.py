"""Policy/value and reward models: OAI's padding convention, heads, reward normalization, save/load."""

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow: errors only

import numpy as np
import pytest
import tensorflow as tf
import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2Model

from lm_human_preference_details.models import (
    PolicyAndValue,
    RewardModel,
    load_causal_lm,
    logprobs_of,
    masked_inputs,
    position_ids_from_mask,
)
from lm_human_preference_details.text import load_tokenizer

ATOL = 1e-5  # fp32


@pytest.fixture(scope="module")
def pad_id():
    return load_tokenizer("tiny").oai_pad_token_id


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    model = PolicyAndValue(load_causal_lm("tiny"))
    with torch.no_grad():  # a non-zero value head, so that values are compared too
        model.value_head.weight.normal_(std=1.0)
        model.value_head.bias.fill_(0.5)
    return model


@pytest.fixture(scope="module")
def reward_model():
    torch.manual_seed(0)
    return RewardModel.from_pretrained_lm("tiny")


def real_sequences(lengths, vocab_size, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def pad_left(sequences, width, pad_id):
    return torch.tensor([[pad_id] * (width - len(s)) + s for s in sequences])


# ----------------------------------------------------------------------------- positions
def test_position_ids_match_tf_exclusive_cumsum():
    rng = np.random.default_rng(0)
    for shape in [(1, 1), (4, 7), (16, 33)]:
        mask = (rng.random(shape) < 0.7).astype(np.int64)
        mask[0, :] = 0  # an all-pad row
        expected = tf.cumsum(tf.constant(mask), axis=1, exclusive=True).numpy()
        actual = position_ids_from_mask(torch.from_numpy(mask))
        np.testing.assert_array_equal(actual.numpy(), expected)


def test_masked_inputs_replace_and_mask_pads():
    ids = torch.tensor([[50259, 50259, 7, 8], [5, 50259, 6, 50259]])
    inputs = masked_inputs(ids, 50259)
    assert inputs["input_ids"].tolist() == [[0, 0, 7, 8], [5, 0, 6, 0]]
    assert inputs["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 0, 1, 0]]
    assert inputs["position_ids"].tolist() == [[0, 0, 0, 1], [0, 1, 1, 2]]


# ----------------------------------------------------------------------------- padding invariance
@torch.no_grad()
def test_policy_logits_and_values_ignore_left_padding(policy, pad_id):
    vocab = policy.lm.config.vocab_size
    seqs = real_sequences([5, 12, 1, 9], vocab, seed=1)
    reference = None
    for width in [12, 15, 30]:
        logits, values = policy(pad_left(seqs, width, pad_id), pad_id)
        assert logits.shape == (len(seqs), width, vocab) and values.shape == (len(seqs), width)
        real = [(logits[i, width - len(s) :], values[i, width - len(s) :]) for i, s in enumerate(seqs)]
        if reference is None:
            reference = real
            continue
        for (l0, v0), (l1, v1) in zip(reference, real):
            assert torch.isfinite(l1).all() and torch.isfinite(v1).all()
            torch.testing.assert_close(l1, l0, rtol=0, atol=ATOL)
            torch.testing.assert_close(v1, v0, rtol=0, atol=ATOL)


@torch.no_grad()
def test_policy_at_positions_is_the_full_forward_sliced(policy, pad_id):
    """`positions` passes only those positions through the output layer: the same logits and values."""
    ids = pad_left(real_sequences([5, 12, 1, 9], policy.lm.config.vocab_size, seed=2), 14, pad_id)
    logits, values = policy(ids, pad_id)
    for positions in (slice(7, -1), slice(13, None), slice(None)):
        sliced_logits, sliced_values = policy(ids, pad_id, positions)
        assert sliced_logits.shape == logits[:, positions].shape
        torch.testing.assert_close(sliced_logits, logits[:, positions], rtol=0, atol=ATOL)
        torch.testing.assert_close(sliced_values, values[:, positions], rtol=0, atol=ATOL)


@torch.no_grad()
def test_policy_pads_between_query_and_suffix_change_nothing(policy, pad_id):
    """OAI right-pads the query and appends the suffix after the pads.

    # OAI: lm_human_preferences/lm_tasks.py#L68-L79
    """
    vocab = policy.lm.config.vocab_size
    query, suffix = real_sequences([6, 3], vocab, seed=2)
    oai_layout = torch.tensor([query + [pad_id] * 4 + suffix])
    ours = torch.tensor([[pad_id] * 4 + query + suffix])
    logits_oai, values_oai = policy(oai_layout, pad_id)
    logits_ours, values_ours = policy(ours, pad_id)
    real_oai = oai_layout[0] != pad_id
    real_ours = ours[0] != pad_id
    torch.testing.assert_close(logits_oai[0, real_oai], logits_ours[0, real_ours], rtol=0, atol=ATOL)
    torch.testing.assert_close(values_oai[0, real_oai], values_ours[0, real_ours], rtol=0, atol=ATOL)


@torch.no_grad()
def test_policy_differs_without_position_fix(policy, pad_id):
    """The property above is not vacuous: plain positions 0..T-1 under padding change the logits."""
    vocab = policy.lm.config.vocab_size
    (seq,) = real_sequences([8], vocab, seed=3)
    padded = pad_left([seq], 14, pad_id)
    inputs = masked_inputs(padded, pad_id)
    naive = policy.lm(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits[0, -8:]
    ours, _ = policy(padded, pad_id)
    assert (naive - ours[0, -8:]).abs().max() > 1e-3


@torch.no_grad()
def test_reward_ignores_left_padding(reward_model, pad_id):
    vocab = reward_model.backbone.config.vocab_size
    seqs = real_sequences([5, 12, 1, 9], vocab, seed=4)
    rewards = [reward_model(pad_left(seqs, width, pad_id), pad_id) for width in [12, 16, 40]]
    assert rewards[0].shape == (len(seqs),)
    assert rewards[0].std() > 1e-3  # the sequences do get different rewards
    for r in rewards[1:]:
        torch.testing.assert_close(r, rewards[0], rtol=0, atol=ATOL)


def test_reward_of_a_truncated_response_is_read_at_its_last_real_token(reward_model, pad_id):
    """OAI gives pad positions the output of the last real token: trailing pads after a truncated response must
    not change its reward.

    # OAI: lm_human_preferences/language/model.py#L334-L340
    """
    vocab = reward_model.backbone.config.vocab_size
    seqs = real_sequences([10, 7, 13], vocab, seed=5)
    trailing = torch.tensor([s + [pad_id] * (16 - len(s)) for s in seqs])  # query+response, then truncation pads
    leading = pad_left(seqs, 16, pad_id)
    torch.testing.assert_close(reward_model(trailing, pad_id), reward_model(leading, pad_id), rtol=0, atol=ATOL)


# ----------------------------------------------------------------------------- logprobs
@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.5])
def test_logprobs_of_is_log_softmax_of_scaled_logits(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    actual = logprobs_of(logits, tokens, temperature)
    assert actual.shape == (3, 5)
    for b in range(3):
        for t in range(5):
            row = [float(x) / temperature for x in logits[b, t]]
            expected = row[tokens[b, t]] - math.log(sum(math.exp(x) for x in row))
            assert abs(actual[b, t].item() - expected) < 1e-5


# ----------------------------------------------------------------------------- heads
def test_value_head_starts_at_zero(pad_id):
    model = PolicyAndValue(load_causal_lm("tiny"))
    assert torch.count_nonzero(model.value_head.weight) == 0 and torch.count_nonzero(model.value_head.bias) == 0
    with torch.no_grad():
        _, values = model(torch.tensor([[pad_id, 1, 2, 3]]), pad_id)
    assert torch.count_nonzero(values[:, 1:]) == 0
    assert not model.training


def test_reward_head_init():
    """N(0, 1/sqrt(d_model + 1)), bias 0, gain 1, bias 0.

    # OAI: lm_human_preferences/language/model.py#L254
    # OAI: lm_human_preferences/rewards.py#L50-L51
    """
    d = 4096  # wide, so that the empirical std of the d weights is within ~1%
    backbone = GPT2Model(
        GPT2Config(vocab_size=34, n_positions=8, n_embd=d, n_layer=0, n_head=4, bos_token_id=0, eos_token_id=0)
    )
    torch.manual_seed(0)
    model = RewardModel(backbone, base_model="wide")
    w = model.head.weight
    assert w.shape == (1, d)
    assert abs(w.std().item() * math.sqrt(d + 1) - 1) < 0.05
    assert abs(w.mean().item()) < 3 / math.sqrt(d + 1) / math.sqrt(d)
    assert model.head.bias.item() == 0.0
    assert model.gain.item() == 1.0 and model.bias.item() == 0.0
    assert {n for n, p in model.named_parameters() if p.requires_grad} >= {"gain", "bias", "head.weight", "head.bias"}
    assert not model.training


# ----------------------------------------------------------------------------- reward normalization
def test_set_reward_norm_maps_samples_to_standard_normal():
    model = RewardModel(
        GPT2Model(
            GPT2Config(vocab_size=34, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
        ),
        "x",
    )
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3.0 + 7.0
    model.set_reward_norm(x.mean().item(), x.std(unbiased=False).item())
    y = model.gain.double() * x + model.bias.double()
    assert abs(y.mean().item()) < 1e-5 and abs(y.std(unbiased=False).item() - 1) < 1e-5
    model.reset_reward_scale()
    model.set_reward_norm(7.0, 3.0, new_mean=2.0, new_std=0.5)
    assert model.gain.item() == pytest.approx(0.5 / 3.0) and model.bias.item() == pytest.approx(2.0 - 0.5 / 3.0 * 7.0)


@torch.no_grad()
def test_set_reward_norm_through_forward(pad_id):
    torch.manual_seed(1)
    model = RewardModel.from_pretrained_lm("tiny")
    vocab = model.backbone.config.vocab_size
    batch = pad_left(real_sequences([int(n) for n in torch.randint(1, 20, (64,))], vocab, seed=5), 20, pad_id)
    raw = model(batch, pad_id)
    model.set_reward_norm(raw.mean().item(), raw.std(unbiased=False).item())
    normalized = model(batch, pad_id)
    assert abs(normalized.mean().item()) < 1e-5
    assert abs(normalized.std(unbiased=False).item() - 1) < 1e-5


def test_set_reward_norm_refuses_unless_reset():
    model = RewardModel(
        GPT2Model(
            GPT2Config(vocab_size=34, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
        ),
        "x",
    )
    with torch.no_grad():
        model.gain.fill_(2.0)
    with pytest.raises(RuntimeError, match="gain 1"):
        model.set_reward_norm(0.0, 1.0)
    with torch.no_grad():
        model.gain.fill_(1.0)
        model.bias.fill_(0.1)
    with pytest.raises(RuntimeError, match="bias 0"):
        model.set_reward_norm(0.0, 1.0)
    model.reset_reward_scale()
    model.set_reward_norm(1.0, 2.0)
    assert model.gain.item() == 0.5 and model.bias.item() == -0.5


# ----------------------------------------------------------------------------- save / load
@torch.no_grad()
def test_reward_model_save_load_round_trip(tmp_path, pad_id):
    torch.manual_seed(2)
    model = RewardModel.from_pretrained_lm("tiny")
    model.head.weight.normal_()
    model.head.bias.fill_(0.25)
    model.gain.fill_(1.7)
    model.bias.fill_(-0.3)
    for p in model.backbone.parameters():  # a trained trunk, not the pretrained one
        p.add_(0.01 * torch.randn_like(p))
    vocab = model.backbone.config.vocab_size
    batch = pad_left(real_sequences([3, 10, 7], vocab, seed=6), 10, pad_id)
    model.save(str(tmp_path / "rm"))
    loaded = RewardModel.load(str(tmp_path / "rm"))
    assert loaded.base_model_name == "tiny"
    assert torch.equal(loaded(batch, pad_id), model(batch, pad_id))
    expected = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


@torch.no_grad()
def test_policy_save_writes_what_load_causal_lm_and_the_value_head_file_read(tmp_path, policy, pad_id):
    """The final policy of stage 2: the same logits from the LM `load_causal_lm` reads back, the same value head."""
    policy.save(str(tmp_path / "policy"))
    lm = load_causal_lm(str(tmp_path / "policy"))
    head = load_file(tmp_path / "policy" / PolicyAndValue.VALUE_HEAD_FILE)
    assert head.keys() == {"weight", "bias"}
    loaded = PolicyAndValue(lm)
    loaded.value_head.load_state_dict(head)
    batch = pad_left(real_sequences([3, 10, 7], lm.config.vocab_size, seed=7), 10, pad_id)
    for got, expected in zip(loaded(batch, pad_id), policy(batch, pad_id)):
        assert torch.equal(got, expected)


def test_reward_model_load_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a reward model folder"):
        RewardModel.load(str(tmp_path))


def test_loaded_gpt2_activation_is_oai_gelu():
    """GPT-2 loads with torch's fused tanh-GELU: OAI's gelu computed by TF, within float32 rounding.

    # OAI: lm_human_preferences/language/model.py#L35-L37
    """
    x = np.random.default_rng(0).normal(0, 3, size=(4096,)).astype(np.float32)
    oai = (0.5 * x * (1 + tf.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * tf.pow(x, 3))))).numpy()
    activation = load_causal_lm("tiny").transformer.h[0].mlp.act
    assert type(activation).__name__ == "GELUTanh"  # one kernel, not transformers' seven-op `gelu_new`
    np.testing.assert_allclose(activation(torch.from_numpy(x)).numpy(), oai, rtol=0, atol=2e-6)
