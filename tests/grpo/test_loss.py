"""Tests of lm_human_preference_details.grpo.loss on small hand-computed cases and autograd checks.

Each expected number below is worked out by hand (in the comment next to it) from the formulas in
PipelineRL's `rl_step` / `populate_rl_data` (ServiceNow/PipelineRL, pipelinerl/finetune/rl/__init__.py),
not by calling the code under test; the peers' options are checked against float64 loops transcribed from
their code, and TRL's losses against TRL 1.16's GRPOTrainer itself, run in its own environment.
"""

import json
import math
import os
import subprocess

import pytest
import torch

from lm_human_preference_details.grpo import loss as gl
from tests.conftest import REPO

F64 = torch.float64


def t(x):
    """A float64 tensor from nested lists."""
    return torch.tensor(x, dtype=F64)


# ----------------------------------------------------------------------------- group_advantages
REWARDS = [1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0]  # two groups of G = 4


def test_group_advantages_mean_baseline():
    # group means 0.5 and 5
    expected = [0.5, -0.5, -0.5, 0.5, -3.0, -1.0, 1.0, 3.0]
    got = gl.group_advantages(t(REWARDS), 4)
    torch.testing.assert_close(got, t(expected))


def test_group_advantages_leave_one_out_baseline():
    # r_0 = 1, the others 0, 0, 1 have mean 1/3 -> 2/3; r_4 = 2, the others 4, 6, 8 have mean 6 -> -4
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, -4.0, -4 / 3, 4 / 3, 4.0]
    got = gl.group_advantages(t(REWARDS), 4, baseline="leave_one_out")
    torch.testing.assert_close(got, t(expected))


def test_leave_one_out_identity_on_random_rewards():
    g = torch.Generator().manual_seed(0)
    for G in [2, 3, 8]:
        r = torch.randn(5 * G, generator=g, dtype=F64)
        loo = gl.group_advantages(r, G, baseline="leave_one_out")
        mean_adv = gl.group_advantages(r, G, baseline="mean")
        torch.testing.assert_close(loo, G / (G - 1) * mean_adv)
        # and literally r_i minus the mean of the other G - 1 rewards of its group
        rg = r.view(-1, G)
        others = (rg.sum(1, keepdim=True) - rg) / (G - 1)
        torch.testing.assert_close(loo, (rg - others).view(-1))


def test_group_advantages_divide_by_std_uses_bessel_correction():
    # group 1: deviations +-0.5, sum of squares 1, sample var 1/3, std 0.57735 (population std would be 0.5)
    # group 2: deviations -3, -1, 1, 3, sum of squares 20, sample var 20/3, std 2.58199
    s1, s2 = math.sqrt(1 / 3), math.sqrt(20 / 3)
    expected = [0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1, -3 / s2, -1 / s2, 1 / s2, 3 / s2]
    got = gl.group_advantages(t(REWARDS), 4, divide_by_std=True, eps=0.0)
    torch.testing.assert_close(got, t(expected))
    assert abs(got[0].item() - 0.8660254) < 1e-6  # 0.5 * sqrt(3); the population std gives 1.0
    loo = gl.group_advantages(t(REWARDS), 4, baseline="leave_one_out", divide_by_std=True, eps=0.0)
    torch.testing.assert_close(loo, t([4 / 3 * e for e in expected]))
    # eps is added to the std
    with_eps = gl.group_advantages(t(REWARDS), 4, divide_by_std=True, eps=0.1)
    assert abs(with_eps[0].item() - 0.5 / (s1 + 0.1)) < 1e-12
    default = gl.group_advantages(t(REWARDS), 4, divide_by_std=True)  # TRL's and PipelineRL's 1e-4
    assert abs(default[0].item() - 0.5 / (s1 + 1e-4)) < 1e-12


def test_group_advantages_constant_group_is_zero_with_std():
    got = gl.group_advantages(t([3.0, 3.0, 3.0, 1.0, 0.0, 0.0]), 3, divide_by_std=True)
    assert torch.all(got[:3] == 0.0)
    assert got[3] > 0 and got[4] < 0


def test_group_advantages_keeps_dtype_and_detaches():
    r = torch.tensor([1.0, 2.0], requires_grad=True)
    got = gl.group_advantages(r, 2)
    assert got.dtype == torch.float32 and not got.requires_grad


def test_group_advantages_bad_sizes():
    with pytest.raises(ValueError, match=r"7.*4"):
        gl.group_advantages(torch.zeros(7), 4)
    with pytest.raises(ValueError, match="group_size"):
        gl.group_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="1-D"):
        gl.group_advantages(torch.zeros(2, 4), 4)
    with pytest.raises(ValueError, match="std_over"):
        gl.group_advantages(torch.zeros(4), 2, divide_by_std=True, std_over="prompt")


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("divide_by_std", [False, True])
def test_a_group_of_one_gets_advantage_zero_as_in_pipelinerl(baseline, divide_by_std):
    """PipelineRL's populate_rl_data: loo_mean = current_reward when group_count is 1, and a NaN std taken as 0."""
    got = gl.group_advantages(torch.arange(3.0) + 1, 1, baseline, divide_by_std, std_over="group")
    assert got.tolist() == [0.0, 0.0, 0.0]


# ----------------------------------------------------------------------------- k3 and ESS
def test_k3_nonnegative_and_zero_when_equal():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(1000, generator=g, dtype=F64) * 5
    b = torch.randn(1000, generator=g, dtype=F64) * 5
    assert torch.all(gl.k3_kl(a, b) >= 0)
    assert torch.all(gl.k3_kl(a, a) == 0)
    # hand value: ref - p = ln 2 -> 2 - ln 2 - 1
    assert abs(gl.k3_kl(t([0.0]), t([math.log(2)])).item() - (1 - math.log(2))) < 1e-12


def test_k3_clamped_stays_finite_and_stops_the_gradient_beyond_the_bound():
    """PipelineRL clamps the reference log ratio at 10: a token the policy made 800 nats less likely than the
    reference gives exp(800) = inf unclamped, and a NaN gradient."""
    new = t([-900.0, -1.0, 0.0]).requires_grad_()
    ref = t([-100.0, -1.5, 0.0])
    assert math.isinf(gl.k3_kl(new, ref)[0].item())
    kl = gl.k3_kl(new, ref, max_log_ratio=gl.REF_LOG_RATIO_CLAMP)
    assert kl[0].item() == pytest.approx(math.exp(10) - 11) and kl[2].item() == 0
    assert kl[1].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)  # within the bound: unchanged
    kl.sum().backward()
    assert new.grad[0].item() == 0 and new.grad[1].item() == pytest.approx(-(math.exp(-0.5) - 1))


def test_k3_expectation_is_kl_exactly_and_by_monte_carlo():
    p = t([0.5, 0.2, 0.15, 0.1, 0.05])
    q = t([0.1, 0.3, 0.2, 0.2, 0.2])
    kl_pq = (p * (p / q).log()).sum()
    # exact expectation over x ~ p (sum_x p(x) q(x)/p(x) = 1, so E[k3] = KL(p||q))
    exact = (p * gl.k3_kl(p.log(), q.log())).sum()
    torch.testing.assert_close(exact, kl_pq)
    # the reverse KL is a different number, so the check above pins the direction
    assert abs((q * (q / p).log()).sum().item() - kl_pq.item()) > 0.1
    # Monte Carlo, fixed seed
    g = torch.Generator().manual_seed(2)
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    mc = gl.k3_kl(p.log()[x], q.log()[x]).mean()
    assert abs(mc.item() - kl_pq.item()) < 0.01, (mc.item(), kl_pq.item())


def test_effective_sample_size():
    ones = torch.ones(4)
    assert abs(gl.effective_sample_size(torch.full((4,), 2.0), ones).item() - 1.0) < 1e-7
    assert abs(gl.effective_sample_size(t([0.0, 0.0, 3.0, 0.0]), ones.double()).item() - 0.25) < 1e-12
    # w = 1, 3: (1 + 3)^2 / (2 * (1 + 9)) = 0.8
    assert abs(gl.effective_sample_size(t([1.0, 3.0]), t([1.0, 1.0])).item() - 0.8) < 1e-12
    # masked-out weights do not count, in N either
    w = t([[1.0, 1.0], [100.0, 0.0]])
    m = torch.tensor([[True, True], [False, False]])
    assert abs(gl.effective_sample_size(w, m).item() - 1.0) < 1e-12
    assert gl.effective_sample_size(w, torch.zeros(2, 2)).item() == 0.0


# ----------------------------------------------------------------------------- policy_loss: gradients
def test_reinforce_gradient_is_capped_ratio_times_advantage():
    new = t([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]]).requires_grad_()
    # log ratios 0.2 (ratio 1.2214, under the cap), 2 (ratio 7.389, above the cap 5), 0 (masked);
    # row 2: log ratios -0.5, 1.0, 1.8 (ratio 6.05, above the cap)
    behaviour = t([[-1.2, -4.0, -0.5], [0.2, -1.7, -2.9]])
    adv = t([2.0, -1.5])
    mask = t([[1, 1, 0], [1, 1, 1]])
    loss = gl.policy_loss(new, behaviour, adv, mask, num_sequences=3, settings=gl.LossSettings(ratio_cap=5.0)).loss
    loss.backward()
    ratio = (new.detach() - behaviour).exp()
    assert ratio[0, 0] < 5 and ratio[0, 1] > 5 and ratio[1, 2] > 5
    # d loss / d new = -A * min(ratio, cap) * mask / num_sequences
    expected = -adv[:, None] * torch.clamp(ratio, max=5.0) * mask / 3
    torch.testing.assert_close(new.grad, expected)
    # by hand for the first row
    assert abs(new.grad[0, 0].item() - (-2.0 * math.exp(0.2) / 3)) < 1e-12
    assert abs(new.grad[0, 1].item() - (-2.0 * 5.0 / 3)) < 1e-12
    assert new.grad[0, 2].item() == 0.0


def test_reinforce_gradient_through_a_policy():
    """Gradient w.r.t. policy parameters = sum over tokens of min(ratio, cap) * A * grad log pi / N."""
    B, T, V, N = 3, 4, 5, 3
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, T, V, generator=g, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    behaviour = logp.detach() + torch.randn(B, T, generator=g, dtype=F64)  # some ratios above 5
    adv = t([1.0, -0.5, 2.0])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    loss = gl.policy_loss(logp, behaviour, adv, mask, num_sequences=N).loss
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)

    w = torch.clamp((logp.detach() - behaviour).exp(), max=5.0)
    assert (w == 5.0).any() and (w < 5.0).any()
    manual = torch.zeros_like(logits)
    for b in range(B):
        for s in range(T):
            if mask[b, s]:
                (gl_bs,) = torch.autograd.grad(logp[b, s], logits, retain_graph=True)
                manual -= w[b, s] * adv[b] * gl_bs / N
    torch.testing.assert_close(grad, manual)


def test_on_policy_reinforce_is_plain_reinforce():
    B, T, V = 4, 3, 6
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(B, T, V, generator=g, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    adv = t([1.0, -1.0, 0.5, 2.0])
    mask = t([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 1, 1]])
    loss, stats, *_ = gl.policy_loss(logp, logp.detach(), adv, mask, num_sequences=B)
    plain = -(logp * adv[:, None] * mask).sum() / B
    torch.testing.assert_close(loss, plain)
    g1 = torch.autograd.grad(loss, logits, retain_graph=True)[0]
    g2 = torch.autograd.grad(plain, logits)[0]
    torch.testing.assert_close(g1, g2)
    assert stats["ratio/mean"].item() == 1.0 and stats["ess"].item() == pytest.approx(1.0)
    assert stats["kl/behaviour"].item() == 0.0 and stats["ratio/clipfrac"].item() == 0.0


def test_ppo_clip_zero_gradient_outside_clip_range_in_favourable_direction():
    # one token per sequence; ratios 1.5, 0.5, 1.1, 0.5; advantages +1, -1, +1, +1
    ratios = t([1.5, 0.5, 1.1, 0.5])
    behaviour = t([[-1.0], [-2.0], [-0.5], [-3.0]])
    new = (behaviour + ratios.log()[:, None]).requires_grad_()
    adv = t([1.0, -1.0, 1.0, 1.0])
    settings = gl.LossSettings(loss_type="ppo_clip", clip_eps=0.2)
    loss, stats, *_ = gl.policy_loss(new, behaviour, adv, torch.ones(4, 1), 4, settings)
    loss.backward()
    # row 0: ratio above 1 + eps with A > 0 -> clipped, no gradient
    # row 1: ratio below 1 - eps with A < 0 -> clipped, no gradient
    # row 2: inside the range -> d(-ratio * A / 4)/d new = -ratio * A / 4
    # row 3: below 1 - eps with A > 0 (unfavourable): the min keeps ratio * A -> gradient -ratio * A / 4
    expected = t([[0.0], [0.0], [-1.1 / 4], [-0.5 / 4]])
    torch.testing.assert_close(new.grad, expected)
    assert stats["ratio/clipfrac"].item() == pytest.approx(0.75)  # 1.5, 0.5, 0.5 are outside [0.8, 1.2]
    # loss by hand: -(min(1.5, 1.2) + min(-0.5, -0.8) + 1.1 + min(0.5, 0.8)) / 4
    #             = -(1.2 - 0.8 + 1.1 + 0.5) / 4
    assert loss.item() == pytest.approx(-0.5)


def test_ppo_clip_with_a_higher_upper_epsilon_lets_favourable_ratios_grow_further():
    """clip-higher (DAPO; PipelineRL's epsilon_high): [1 - 0.2, 1 + 0.28] keeps the gradient of a ratio of 1.25
    with A > 0, which [0.8, 1.2] clips; the lower side is unchanged."""
    ratios = t([1.25, 0.75])
    behaviour = t([[-1.0], [-2.0]])
    adv = t([1.0, -1.0])
    grads = {}
    for high in (None, 0.28):
        new = (behaviour + ratios.log()[:, None]).requires_grad_()
        settings = gl.LossSettings(loss_type="ppo_clip", clip_eps=0.2, clip_eps_high=high)
        loss, stats, *_ = gl.policy_loss(new, behaviour, adv, torch.ones(2, 1), 2, settings)
        loss.backward()
        grads[high] = (new.grad, stats["ratio/clipfrac"].item())
    torch.testing.assert_close(grads[None][0], t([[0.0], [0.0]]))  # both clipped in their favourable direction
    torch.testing.assert_close(grads[0.28][0], t([[-1.25 / 2], [0.0]]))  # 1.25 < 1.28: kept; 0.75 < 0.8: still clipped
    assert grads[None][1] == pytest.approx(1.0) and grads[0.28][1] == pytest.approx(0.5)


def test_kl_penalty_gradient():
    new = t([[-1.0, -2.0], [-0.5, -0.25]]).requires_grad_()
    behaviour = new.detach().clone()  # on policy: the policy part is -A / N per token
    ref = t([[-1.5, -1.0], [-0.5, -3.0]])
    adv = t([1.0, -2.0])
    mask = t([[1, 1], [1, 0]])
    beta, N = 0.3, 2
    loss, stats, *_ = gl.policy_loss(new, behaviour, adv, mask, N, gl.LossSettings(kl_coef=beta), ref_logprobs=ref)
    loss.backward()
    # d/dnew of +beta * k3 = beta * (1 - exp(ref - new))
    expected = (-adv[:, None] + beta * (1 - (ref - new.detach()).exp())) * mask / N
    torch.testing.assert_close(new.grad, expected)
    k3 = (ref - new.detach()).exp() - (ref - new.detach()) - 1
    torch.testing.assert_close(stats["kl/ref"], (k3 * mask).sum() / 3)


def test_kl_coef_without_reference_is_an_error():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        gl.policy_loss(x, x, torch.zeros(1), torch.ones(1, 2), 1, gl.LossSettings(kl_coef=0.1))
    with pytest.raises(ValueError, match="loss_type"):
        gl.policy_loss(x, x, torch.zeros(1), torch.ones(1, 2), 1, gl.LossSettings(loss_type="dpo"))
    # a reference with kl_coef 0 is only logged: the loss is unchanged
    ref = torch.full((1, 2), -1.0)
    a = gl.policy_loss(x, x, torch.ones(1), torch.ones(1, 2), 1).loss
    b, stats, *_ = gl.policy_loss(x, x, torch.ones(1), torch.ones(1, 2), 1, ref_logprobs=ref)
    assert a.item() == b.item() and "kl/ref" in stats
    assert "kl/ref" not in gl.policy_loss(x, x, torch.ones(1), torch.ones(1, 2), 1)[1]


# ----------------------------------------------------------------------------- normalisation and mask
def _random_batch(seed, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(B, T, generator=g, dtype=F64) * 3
    new = behaviour + torch.randn(B, T, generator=g, dtype=F64) * 0.8
    ref = behaviour + torch.randn(B, T, generator=g, dtype=F64) * 0.5
    adv = torch.randn(B, generator=g, dtype=F64)
    mask = (torch.rand(B, T, generator=g) < 0.7).to(F64)
    return new, behaviour, ref, adv, mask


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_micro_batches_sum_to_the_full_batch_loss(loss_type):
    new, behaviour, ref, adv, mask = _random_batch(5)

    def run(rows, with_ref):
        x = new[rows].clone().requires_grad_()
        settings = gl.LossSettings(loss_type=loss_type, kl_coef=0.1 if with_ref else 0.0)
        reference = ref[rows] if with_ref else None
        loss = gl.policy_loss(x, behaviour[rows], adv[rows], mask[rows], 6, settings, ref_logprobs=reference).loss
        loss.backward()
        return loss, x.grad

    for with_ref in [False, True]:
        full, g_full = run(slice(0, 6), with_ref)
        a, g_a = run(slice(0, 2), with_ref)
        b, g_b = run(slice(2, 6), with_ref)
        torch.testing.assert_close(a + b, full)
        torch.testing.assert_close(torch.cat([g_a, g_b]), g_full)
        # dividing by the micro-batch's own size instead would not add up
        settings = gl.LossSettings(loss_type=loss_type)
        a_own = gl.policy_loss(new[:2], behaviour[:2], adv[:2], mask[:2], 2, settings).loss
        b_own = gl.policy_loss(new[2:], behaviour[2:], adv[2:], mask[2:], 4, settings).loss
        if not with_ref:
            assert abs((a_own + b_own - full).item()) > 1e-3


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_mask_excludes_tokens(loss_type):
    new, behaviour, ref, adv, mask = _random_batch(6)
    mask[0, 0], mask[0, 1] = 0.0, 1.0
    new = new.clone().requires_grad_()
    settings = gl.LossSettings(loss_type=loss_type, kl_coef=0.2)
    loss, stats, *_ = gl.policy_loss(new, behaviour, adv, mask, 6, settings, ref_logprobs=ref)
    loss.backward()
    assert torch.all(new.grad[mask == 0] == 0)
    assert torch.any(new.grad[mask == 1] != 0)

    # garbage (huge ratios, far reference) at the masked-out positions changes nothing
    off = mask == 0
    new2 = torch.where(off, new.detach() + 20.0, new.detach())
    behaviour2 = torch.where(off, behaviour - 30.0, behaviour)
    ref2 = torch.where(off, ref - 40.0, ref)
    loss2, stats2, *_ = gl.policy_loss(new2, behaviour2, adv, mask, 6, settings, ref_logprobs=ref2)
    torch.testing.assert_close(loss2, loss.detach())
    for k in stats:
        torch.testing.assert_close(stats2[k], stats[k], msg=k)

    # a bool mask is the same as a float one
    loss3 = gl.policy_loss(new.detach(), behaviour, adv, mask.bool(), 6, settings, ref_logprobs=ref).loss
    torch.testing.assert_close(loss3, loss.detach())


def test_per_token_advantages_match_broadcast_per_sequence_ones():
    new, behaviour, _, adv, mask = _random_batch(7)
    a = gl.policy_loss(new, behaviour, adv, mask, 6).loss
    b = gl.policy_loss(new, behaviour, adv[:, None].expand_as(new), mask, 6).loss
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="advantages"):
        gl.policy_loss(new, behaviour, adv[:3], mask, 6)


# ----------------------------------------------------------------------------- stats on a hand case
def _hand_case():
    ln2, ln8 = math.log(2), math.log(8)
    new = t([[-1.0, -2.0], [-0.5, -3.0]])
    # ratios [[1, 2], [8, 100]]; the 100 sits under mask 0
    behaviour = t([[-1.0, -2.0 - ln2], [-0.5 - ln8, -3.0 - math.log(100)]])
    # ref - new = [[0, ln 2], [-ln 2, 5]]; the 5 sits under mask 0
    ref = new + t([[0.0, ln2], [-ln2, 5.0]])
    mask = t([[1, 1], [1, 0]])
    adv = t([1.0, 2.0])
    return new, behaviour, ref, mask, adv


def test_stats_on_a_hand_case():
    new, behaviour, ref, mask, adv = _hand_case()
    loss, s, *_ = gl.policy_loss(new, behaviour, adv, mask, 4, gl.LossSettings(ratio_cap=5.0), ref_logprobs=ref)
    assert set(s) == {
        "ratio/mean", "ratio/max", "ratio/clipfrac", "ess", "logprob/new_mean", "kl/behaviour", "kl/ref",
        "weight/mean", "weight/max", "weight/ess",
    }  # fmt: skip
    assert all(v.dim() == 0 and not v.requires_grad for v in s.values())
    # masked ratios 1, 2, 8
    assert s["ratio/mean"].item() == pytest.approx(11 / 3)
    assert s["ratio/max"].item() == pytest.approx(8.0)
    assert s["ratio/clipfrac"].item() == pytest.approx(1 / 3)  # only 8 is above the cap 5
    assert s["ess"].item() == pytest.approx(121 / 207)  # (1 + 2 + 8)^2 / (3 * (1 + 4 + 64))
    # the capped weights the loss applied, 1, 2, 5 (PipelineRL's reinforce logs these as ratio_new_old)
    assert s["weight/mean"].item() == pytest.approx(8 / 3) and s["weight/max"].item() == 5.0
    assert s["weight/ess"].item() == pytest.approx(64 / 90)  # (1 + 2 + 5)^2 / (3 * (1 + 4 + 25))
    assert s["logprob/new_mean"].item() == pytest.approx(-3.5 / 3)
    # k3(behaviour, new) = r - ln r - 1 for r = 1, 2, 8: 0, 1 - ln 2, 7 - ln 8
    assert s["kl/behaviour"].item() == pytest.approx((8 - math.log(16)) / 3)
    # k3(new, ref) = e^d - d - 1 for d = 0, ln 2, -ln 2: 0, 1 - ln 2, ln 2 - 0.5
    assert s["kl/ref"].item() == pytest.approx(1 / 6)
    # loss: objective new * A * min(r, 5) = -1*1*1 - 2*1*2 - 0.5*2*5 = -10; loss = 10 / 4
    assert loss.item() == pytest.approx(2.5)
    loss_kl = gl.policy_loss(new, behaviour, adv, mask, 4, gl.LossSettings(kl_coef=0.5), ref_logprobs=ref).loss
    assert loss_kl.item() == pytest.approx((10 + 0.5 * 0.5) / 4)  # k3 sum is 0.5


def test_ppo_clip_stats_and_loss_on_the_hand_case():
    new, behaviour, _, mask, adv = _hand_case()
    loss, s, *_ = gl.policy_loss(new, behaviour, adv, mask, 4, gl.LossSettings(loss_type="ppo_clip", clip_eps=0.2))
    assert s["ratio/clipfrac"].item() == pytest.approx(2 / 3)  # 2 and 8 are outside [0.8, 1.2]
    assert "kl/ref" not in s
    # min(1, 1) + min(2, 1.2) * 1 + min(8 * 2, 1.2 * 2) = 1 + 1.2 + 2.4 = 4.6
    assert loss.item() == pytest.approx(-4.6 / 4)


# ----------------------------------------------------------------------------- the peers' options, against loops
# Each reference below is a float64 loop transcribed from the peer's code (PipelineRL at 58d3934, TRL 1.16.0; the
# lines are named), one rollout or token at a time, independent of the vectorised code under test.


def pipelinerl_advantages(rewards: list[float], group_size: int, divide_by_std: bool) -> list[float]:
    """PipelineRL: pipelinerl/finetune/rl/__init__.py#L507-L520 (`populate_rl_data`'s calculate_advantages)."""
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        count, total = len(group), sum(group)
        mean = total / count
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (count - 1)) if count > 1 else 0.0  # pandas' NaN -> 0
        for r in group:
            loo_mean = (total - r) / (count - 1) if count > 1 else r
            out.append((r - loo_mean) / (std + 1e-4) if divide_by_std else r - loo_mean)
    return out


def trl_advantages(rewards: list[float], group_size: int, scale_rewards: str) -> list[float]:
    """TRL: trl/trainer/grpo_trainer.py#L2763-L2787 (group mean; std of the group or the batch, Bessel's)."""

    def std(xs):
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    out = []
    for i, r in enumerate(rewards):
        group = rewards[i - i % group_size : i - i % group_size + group_size]
        adv = r - sum(group) / group_size
        if scale_rewards != "none":
            adv /= (std(group) if scale_rewards == "group" else std(rewards)) + 1e-4
        out.append(adv)
    return out


@pytest.mark.parametrize("group_size", [1, 2, 3, 5])
@pytest.mark.parametrize("divide_by_std", [False, True])
def test_leave_one_out_advantages_match_pipelinerls_populate_rl_data(group_size, divide_by_std):
    rewards = torch.randn(group_size * 4, dtype=F64).round(decimals=1)  # ties too: a zero-std group or two
    rewards[:group_size] = 1.0
    got = gl.group_advantages(rewards, group_size, "leave_one_out", divide_by_std)
    expected = pipelinerl_advantages(rewards.tolist(), group_size, divide_by_std)
    torch.testing.assert_close(got, t(expected), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scale_rewards", ["none", "group", "batch"])
def test_mean_baseline_advantages_match_trls_scale_rewards(scale_rewards):
    rewards = torch.randn(12, dtype=F64)
    got = gl.group_advantages(
        rewards, 4, "mean", scale_rewards != "none", std_over=scale_rewards.replace("none", "group")
    )
    torch.testing.assert_close(got, t(trl_advantages(rewards.tolist(), 4, scale_rewards)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("use_advantages", [True, False])
@pytest.mark.parametrize("relu", [True, False])
def test_policy_weights_match_pipelinerls_log_p_weights(use_advantages, relu):
    advantages, rewards = t([-1.5, 0.0, 2.0, 0.5]), t([0.0, 1.0, 1.0, -3.0])
    # PipelineRL: pipelinerl/finetune/rl/__init__.py#L276-L278
    expected = [max(w, 0.0) if relu else w for w in (advantages if use_advantages else rewards).tolist()]
    assert gl.policy_weights(advantages, rewards, use_advantages, relu).tolist() == expected


def test_linear_decay_is_pipelinerls_schedule():
    # PipelineRL: pipelinerl/finetune/rl/__init__.py#L133, initial + (final - initial) * current_step / max_step
    assert [gl.linear_decay(s, 4, 0.1, 0.02) for s in range(5)] == pytest.approx([0.1, 0.08, 0.06, 0.04, 0.02])
    assert gl.linear_decay(3, 10, 0.5, 0.5) == 0.5


def _rows(seed=3, B=5, T=6):
    new, behaviour, ref, adv, mask = _random_batch(seed, B, T)
    mask[:, 0] = 1.0  # every row has a token
    mask[-1] = 0.0  # and one (a completion dropped by overlong filtering) has none
    mask[-1, 0] = 0.0
    return new, behaviour, ref, adv, mask


@pytest.mark.parametrize("normalizer", ["sequences", "sequence_mean", "tokens", "max_tokens", "group_tokens"])
def test_token_weights_match_the_peers_normalisers_and_micro_batches_add_up(normalizer):
    new, behaviour, _, adv, mask = _rows()
    B, T = mask.shape
    group_tokens = t([7.0, 7.0, 9.5, 9.5, 4.0])
    kwargs = dict(num_tokens=int(mask.sum()), max_tokens=8, group_tokens=group_tokens)
    weights = gl.token_weights(mask, normalizer, B, **kwargs)
    for b in range(B):
        for k in range(T):
            if mask[b, k] == 0:
                expected = 0.0
            elif normalizer == "sequences":  # PipelineRL#L250: 1 / batch_size
                expected = 1 / B
            elif normalizer == "sequence_mean":  # TRL#L3154: each row's mean, then the mean over rows
                expected = 1 / (mask[b].sum().item() * B)
            elif normalizer == "tokens":  # TRL#L3170: num_items_in_batch
                expected = 1 / mask.sum().item()
            elif normalizer == "max_tokens":  # TRL#L3164: B * max_completion_length
                expected = 1 / (B * 8)
            else:  # PipelineRL#L248: 1 / group_tokens
                expected = 1 / group_tokens[b].item()
            assert weights[b, k].item() == pytest.approx(expected, rel=1e-12)
    # the batch's counts in each micro-batch: the micro-batch losses add up to the batch's
    whole = gl.policy_loss(new, behaviour, adv, mask, B, weights=weights).loss
    parts = sum(
        gl.policy_loss(
            new[rows],
            behaviour[rows],
            adv[rows],
            mask[rows],
            B,
            weights=gl.token_weights(mask[rows], normalizer, B, **{**kwargs, "group_tokens": group_tokens[rows]}),
        )[0]
        for rows in (slice(0, 2), slice(2, 5))
    )
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)
    if normalizer == "sequences":  # the default path, unweighted
        assert gl.policy_loss(new, behaviour, adv, mask, B)[0].item() == pytest.approx(whole.item(), rel=1e-12)


def test_token_weights_refuse_a_missing_count():
    mask = torch.ones(2, 3)
    for normalizer, message in (("tokens", "num_tokens"), ("max_tokens", "max_tokens"), ("group_tokens", "shape")):
        with pytest.raises(ValueError, match=message):
            gl.token_weights(mask, normalizer, 2)
    with pytest.raises(ValueError, match="unknown normalizer"):
        gl.token_weights(mask, "bnpo", 2)


def pipelinerl_token_loss(new, behaviour, ref, log_p_weight, entropy, token_weight, epsilon_high, clamp, kl, bonus):
    """PipelineRL: pipelinerl/finetune/rl/__init__.py#L280-L361, case reinforce, one token: the per-token loss that
    rl_step sums over the masked tokens (torch scalars, so that autograd gives its gradient)."""
    ratio = torch.exp(new - behaviour)
    log_ratio_ref_new = torch.clamp(ref - new, -clamp, clamp)
    approx_kl = torch.exp(log_ratio_ref_new) - log_ratio_ref_new - 1
    policy = new * log_p_weight * torch.clamp(ratio, 0, 1 + epsilon_high).detach()
    return -(policy - kl * approx_kl + bonus * entropy) * token_weight


def test_reinforce_with_every_pipelinerl_option_matches_a_loop_of_its_rl_step():
    """Its base.yaml's cap (1 + 0.02) and KL clamp (5), a KL coefficient and an entropy bonus, relu'd weights,
    group normalisation and overlong filtering (the last row), against the loop, value and gradient."""
    new, behaviour, ref, adv, mask = _rows()
    ref = ref - 6 * (torch.arange(6, dtype=F64) == 2)  # some log ratios beyond the clamp of 5
    entropy = torch.rand(mask.shape, dtype=F64) * 2
    group_tokens = t([7.0, 7.0, 9.5, 9.5, 4.0])
    weights = gl.token_weights(mask, "group_tokens", 5, group_tokens=group_tokens)
    log_p_weights = gl.policy_weights(adv, adv, relu=True)
    ours_new, ours_entropy = new.clone().requires_grad_(), entropy.clone().requires_grad_()
    settings = gl.LossSettings(ratio_cap=1.02, kl_coef=0.3, kl_clamp=5.0, entropy_coef=0.01)
    loss = gl.policy_loss(
        ours_new, behaviour, log_p_weights, mask, 5, settings, ref_logprobs=ref, entropy=ours_entropy, weights=weights
    ).loss
    loss.backward()
    loop_new, loop_entropy = new.clone().requires_grad_(), entropy.clone().requires_grad_()
    expected = sum(
        pipelinerl_token_loss(
            loop_new[b, k], behaviour[b, k], ref[b, k], max(adv[b].item(), 0.0), loop_entropy[b, k],
            1 / group_tokens[b].item(), 0.02, 5.0, 0.3, 0.01,
        )
        for b in range(5)
        for k in range(6)
        if mask[b, k]
    )  # fmt: skip
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_new.grad, loop_new.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_entropy.grad, loop_entropy.grad, rtol=1e-12, atol=1e-12)
    assert ((ref - new).abs() * mask).max() > 5  # the clamp was in play


def test_gspo_matches_a_loop_of_pipelinerls_gspo_case():
    """PipelineRL: pipelinerl/finetune/rl/__init__.py#L310-L348: the sequence's ratio exp(mean log ratio), its mean
    advantage, clipped with epsilon_low and epsilon_high, times the sum of its token weights."""
    new, behaviour, _, adv, mask = _rows()
    ours_new = new.clone().requires_grad_()
    settings = gl.LossSettings(loss_type="gspo", clip_eps=0.1, clip_eps_high=0.2)
    loss, stats, *_ = gl.policy_loss(ours_new, behaviour, adv, mask, 5, settings)
    loss.backward()
    loop_new = new.clone().requires_grad_()
    expected, clipped_tokens = 0.0, 0
    for b in range(5):
        tokens = [k for k in range(6) if mask[b, k]]
        if not tokens:
            continue
        s = torch.exp(sum(loop_new[b, k] - behaviour[b, k] for k in tokens) / len(tokens))
        a = adv[b].item()
        clamped = torch.clamp(s, 1 - 0.1, 1 + 0.2)
        weight_sum = len(tokens) / 5  # tokens_weights = 1 / batch_size, summed over the sequence
        expected = expected - torch.min(s * a, clamped * a) * weight_sum
        clipped_tokens += len(tokens) * bool(clamped != s)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_new.grad, loop_new.grad, rtol=1e-12, atol=1e-12)
    assert stats["ratio/clipfrac"].item() == pytest.approx(clipped_tokens / mask.sum().item())
    assert 0 < clipped_tokens < mask.sum()  # some sequences clipped, some not


def trl_importance_weights(log_ratio, mask, mode: str, cap: float) -> list[list[float]]:
    """TRL: trl/trainer/grpo_trainer.py#L2660-L2705, vllm_importance_sampling_ratio with clip_min None, a loop."""
    out = []
    for b in range(log_ratio.shape[0]):
        diffs = [log_ratio[b, k].item() * mask[b, k].item() for k in range(log_ratio.shape[1])]
        ratios = [math.exp(sum(diffs))] * len(diffs) if mode.startswith("sequence") else [math.exp(d) for d in diffs]
        out.append([min(r, cap) if mode.endswith("truncate") else (0.0 if r > cap else r) for r in ratios])
    return out


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_reinforce_weights_match_trls_truncated_importance_sampling(mode):
    new, behaviour, _, adv, mask = _rows()
    log_ratio = (new - behaviour) * 0.5  # some tokens and sequences above the cap, some below
    weights, capped = gl.reinforce_weights(log_ratio, mask, 1.3, mode)
    expected = t(trl_importance_weights(log_ratio, mask, mode, 1.3))
    torch.testing.assert_close(weights * mask, expected * mask, rtol=1e-12, atol=1e-12)
    assert 0 < (capped * mask).sum() < mask.sum()
    # the loss's gradient is that weight times the advantage (and its stats say so)
    ours_new = (behaviour + log_ratio).clone().requires_grad_()
    settings = gl.LossSettings(ratio_cap=1.3, importance_sampling=mode)
    loss, stats, *_ = gl.policy_loss(ours_new, behaviour, adv, mask, 5, settings)
    loss.backward()
    torch.testing.assert_close(ours_new.grad, -expected * adv[:, None] * mask / 5, rtol=1e-12, atol=1e-12)
    assert stats["weight/max"].item() == pytest.approx((expected * mask).max().item())
    with pytest.raises(ValueError, match="reinforce"):
        gl.policy_loss(ours_new, behaviour, adv, mask, 5, gl.LossSettings("ppo_clip", importance_sampling="token_mask"))


def test_entropy_coef_without_entropy_is_an_error():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="needs entropy"):
        gl.policy_loss(x, x, torch.zeros(1), torch.ones(1, 2), 1, gl.LossSettings(entropy_coef=0.1))


# ----------------------------------------------------------------------------- TRL's GRPOTrainer itself
TRL_LOSS = r"""
import collections, json, sys, types
import torch
from trl.trainer.grpo_trainer import GRPOTrainer

class Accelerator:  # one process
    num_processes, sync_gradients = 1, True
    def gather(self, x): return x
    def reduce(self, x, reduction): return x

results = []
for case in json.load(sys.stdin):
    f64 = lambda key: None if case[key] is None else torch.tensor(case[key], dtype=torch.float64)
    logps = f64("logprobs").requires_grad_()
    mask = f64("mask")
    B, T = mask.shape
    trainer = types.SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, aux_loss_enabled=False,
        importance_sampling_level=case["importance_sampling_level"], loss_type=case["loss_type"],
        epsilon_low=case["epsilon"], epsilon_high=case["epsilon_high"], beta=case["beta"],
        use_vllm=case["is_ratio"] is not None, vllm_importance_sampling_correction=case["is_ratio"] is not None,
        max_completion_length=case["max_completion_length"], current_gradient_accumulation_steps=1,
        model=types.SimpleNamespace(training=True), accelerator=Accelerator(), _entropy_bonus_enabled=False,
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        _metrics={"train": collections.defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, torch.zeros_like(logps), None),
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
        "advantages": f64("advantages"), "old_per_token_logps": f64("old"), "ref_per_token_logps": f64("ref"),
        "importance_sampling_ratio": f64("is_ratio"), "num_items_in_batch": mask.sum(),
    }
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    results.append({"loss": loss.item(), "grad": logps.grad.tolist()})
print(json.dumps(results))
"""


def trl116_python() -> str:
    """TRL 1.16's environment: LMHPD_TRL116_PYTHON (tests/run.sh sets it), else made (or found) by trl_env.sh."""
    if os.environ.get("LMHPD_TRL116_PYTHON"):
        return os.environ["LMHPD_TRL116_PYTHON"]
    made = subprocess.run(
        ["bash", "benchmarks/trl_env.sh", ".venv-trl116", "1.16.0"],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    return made.stdout.strip().splitlines()[-1]


def run_trl(cases: list[dict]) -> list[dict]:
    """TRL 1.16's `GRPOTrainer._compute_loss` itself on each case, in its own environment (a subprocess): a trainer
    stand-in holds the settings, its model's per-token logprobs are the case's."""
    result = subprocess.run(
        [trl116_python(), "-c", TRL_LOSS], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])  # the last line: TRL prints notices of its own on import


TRL_NORMALISERS = {"grpo": "sequence_mean", "bnpo": "tokens", "dr_grpo": "max_tokens", "dapo": "tokens"}


def test_our_losses_are_trls_on_the_same_inputs():
    """TRL's loss types (its normalisers) with PPO's ratio to older logprobs and a KL penalty; its truncated importance
    sampling at one gradient step per batch (its ratio is then 1, its correction weighs the gradient: our reinforce);
    GSPO (its importance_sampling_level sequence): loss and gradient, float64, against ours."""
    new, behaviour, ref, adv, mask = _rows()
    B = mask.shape[0]
    log_ratio = new - behaviour
    cases, ours = [], []
    base = dict(logprobs=new.tolist(), mask=mask.tolist(), advantages=adv.tolist(), ref=None, is_ratio=None)
    base |= dict(importance_sampling_level="token", epsilon=0.2, epsilon_high=0.28, beta=0.0, max_completion_length=8)
    for loss_type, normalizer in TRL_NORMALISERS.items():  # PPO-clip against older logprobs, with a KL penalty
        cases.append(base | dict(loss_type=loss_type, old=behaviour.tolist(), ref=ref.tolist(), beta=0.04))
        ours.append((normalizer, gl.LossSettings("ppo_clip", clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.04)))
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):  # TIS at cap 1.3
        is_ratio = trl_importance_weights(log_ratio, mask, mode, 1.3)
        cases.append(base | dict(loss_type="dapo", old=None, is_ratio=is_ratio))
        ours.append(("tokens", gl.LossSettings(ratio_cap=1.3, importance_sampling=mode)))
    cases.append(base | dict(loss_type="grpo", importance_sampling_level="sequence", old=behaviour.tolist()))
    ours.append(("sequence_mean", gl.LossSettings("gspo", clip_eps=0.2, clip_eps_high=0.28)))
    for (normalizer, settings), case, trl in zip(ours, cases, run_trl(cases)):
        ours_new = new.clone().requires_grad_()
        weights = gl.token_weights(mask, normalizer, B, num_tokens=int(mask.sum()), max_tokens=8)
        reference = ref if settings.kl_coef else None
        loss = gl.policy_loss(ours_new, behaviour, adv, mask, B, settings, ref_logprobs=reference, weights=weights).loss
        loss.backward()
        torch.testing.assert_close(ours_new.grad, t(trl["grad"]), rtol=1e-10, atol=1e-12, msg=str(case["loss_type"]))
        if case["is_ratio"] is None:  # TRL's objective is ratio * A, ours for reinforce log pi * w * A: same gradient
            assert loss.item() == pytest.approx(trl["loss"], rel=1e-10, abs=1e-12), case["loss_type"]
        assert ours_new.grad.abs().max() > 0
