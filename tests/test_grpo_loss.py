"""Tests of lm_human_preference_details.grpo.loss on small hand-computed cases and autograd checks.

Each expected number below is worked out by hand (in the comment next to it) from the formulas in
PipelineRL's `rl_step` / `populate_rl_data` (ServiceNow/PipelineRL, pipelinerl/finetune/rl/__init__.py),
not by calling the code under test.
"""

import math

import pytest
import torch

from lm_human_preference_details.grpo import loss as gl

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
        gl.group_advantages(torch.zeros(4), 1, baseline="leave_one_out")
    with pytest.raises(ValueError, match="group_size"):
        gl.group_advantages(torch.zeros(4), 1, divide_by_std=True)
    with pytest.raises(ValueError, match="group_size"):
        gl.group_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="1-D"):
        gl.group_advantages(torch.zeros(2, 4), 4)
    # group_size 1 with the mean baseline is allowed (all advantages 0)
    assert torch.all(gl.group_advantages(torch.arange(3.0), 1) == 0)


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
    loss, _ = gl.policy_loss(new, behaviour, adv, mask, num_sequences=3, ratio_cap=5.0)
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
    loss, _ = gl.policy_loss(logp, behaviour, adv, mask, num_sequences=N)
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
    loss, stats = gl.policy_loss(logp, logp.detach(), adv, mask, num_sequences=B)
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
    loss, stats = gl.policy_loss(new, behaviour, adv, torch.ones(4, 1), 4, loss_type="ppo_clip", clip_eps=0.2)
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
        loss, stats = gl.policy_loss(
            new, behaviour, adv, torch.ones(2, 1), 2, loss_type="ppo_clip", clip_eps=0.2, clip_eps_high=high
        )
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
    loss, stats = gl.policy_loss(new, behaviour, adv, mask, N, ref_logprobs=ref, kl_coef=beta)
    loss.backward()
    # d/dnew of +beta * k3 = beta * (1 - exp(ref - new))
    expected = (-adv[:, None] + beta * (1 - (ref - new.detach()).exp())) * mask / N
    torch.testing.assert_close(new.grad, expected)
    k3 = (ref - new.detach()).exp() - (ref - new.detach()) - 1
    torch.testing.assert_close(stats["kl/ref"], (k3 * mask).sum() / 3)


def test_kl_coef_without_reference_is_an_error():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        gl.policy_loss(x, x, torch.zeros(1), torch.ones(1, 2), 1, kl_coef=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        gl.policy_loss(x, x, torch.zeros(1), torch.ones(1, 2), 1, loss_type="gspo")
    # a reference with kl_coef 0 is only logged: the loss is unchanged
    ref = torch.full((1, 2), -1.0)
    a, _ = gl.policy_loss(x, x, torch.ones(1), torch.ones(1, 2), 1)
    b, stats = gl.policy_loss(x, x, torch.ones(1), torch.ones(1, 2), 1, ref_logprobs=ref)
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
    kw = dict(loss_type=loss_type, ref_logprobs=None, kl_coef=0.0)

    def run(rows, with_ref):
        x = new[rows].clone().requires_grad_()
        extra = dict(ref_logprobs=ref[rows], kl_coef=0.1) if with_ref else {}
        loss, _ = gl.policy_loss(x, behaviour[rows], adv[rows], mask[rows], 6, **{**kw, **extra})
        loss.backward()
        return loss, x.grad

    for with_ref in [False, True]:
        full, g_full = run(slice(0, 6), with_ref)
        a, g_a = run(slice(0, 2), with_ref)
        b, g_b = run(slice(2, 6), with_ref)
        torch.testing.assert_close(a + b, full)
        torch.testing.assert_close(torch.cat([g_a, g_b]), g_full)
        # dividing by the micro-batch's own size instead would not add up
        a_own, _ = gl.policy_loss(new[:2], behaviour[:2], adv[:2], mask[:2], 2, loss_type=loss_type)
        b_own, _ = gl.policy_loss(new[2:], behaviour[2:], adv[2:], mask[2:], 4, loss_type=loss_type)
        if not with_ref:
            assert abs((a_own + b_own - full).item()) > 1e-3


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_mask_excludes_tokens(loss_type):
    new, behaviour, ref, adv, mask = _random_batch(6)
    mask[0, 0], mask[0, 1] = 0.0, 1.0
    new = new.clone().requires_grad_()
    kw = dict(loss_type=loss_type, kl_coef=0.2)
    loss, stats = gl.policy_loss(new, behaviour, adv, mask, 6, ref_logprobs=ref, **kw)
    loss.backward()
    assert torch.all(new.grad[mask == 0] == 0)
    assert torch.any(new.grad[mask == 1] != 0)

    # garbage (huge ratios, far reference) at the masked-out positions changes nothing
    off = mask == 0
    new2 = torch.where(off, new.detach() + 20.0, new.detach())
    behaviour2 = torch.where(off, behaviour - 30.0, behaviour)
    ref2 = torch.where(off, ref - 40.0, ref)
    loss2, stats2 = gl.policy_loss(new2, behaviour2, adv, mask, 6, ref_logprobs=ref2, **kw)
    torch.testing.assert_close(loss2, loss.detach())
    for k in stats:
        torch.testing.assert_close(stats2[k], stats[k], msg=k)

    # a bool mask is the same as a float one
    loss3, _ = gl.policy_loss(new.detach(), behaviour, adv, mask.bool(), 6, ref_logprobs=ref, **kw)
    torch.testing.assert_close(loss3, loss.detach())


def test_per_token_advantages_match_broadcast_per_sequence_ones():
    new, behaviour, _, adv, mask = _random_batch(7)
    a, _ = gl.policy_loss(new, behaviour, adv, mask, 6)
    b, _ = gl.policy_loss(new, behaviour, adv[:, None].expand_as(new), mask, 6)
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
    loss, s = gl.policy_loss(new, behaviour, adv, mask, 4, ratio_cap=5.0, ref_logprobs=ref)
    assert set(s) == {
        "ratio/mean", "ratio/max", "ratio/clipfrac", "ess", "logprob/new_mean", "kl/behaviour", "kl/ref",
    }  # fmt: skip
    assert all(v.dim() == 0 and not v.requires_grad for v in s.values())
    # masked ratios 1, 2, 8
    assert s["ratio/mean"].item() == pytest.approx(11 / 3)
    assert s["ratio/max"].item() == pytest.approx(8.0)
    assert s["ratio/clipfrac"].item() == pytest.approx(1 / 3)  # only 8 is above the cap 5
    assert s["ess"].item() == pytest.approx(121 / 207)  # (1 + 2 + 8)^2 / (3 * (1 + 4 + 64))
    assert s["logprob/new_mean"].item() == pytest.approx(-3.5 / 3)
    # k3(behaviour, new) = r - ln r - 1 for r = 1, 2, 8: 0, 1 - ln 2, 7 - ln 8
    assert s["kl/behaviour"].item() == pytest.approx((8 - math.log(16)) / 3)
    # k3(new, ref) = e^d - d - 1 for d = 0, ln 2, -ln 2: 0, 1 - ln 2, ln 2 - 0.5
    assert s["kl/ref"].item() == pytest.approx(1 / 6)
    # loss: objective new * A * min(r, 5) = -1*1*1 - 2*1*2 - 0.5*2*5 = -10; loss = 10 / 4
    assert loss.item() == pytest.approx(2.5)
    loss_kl, _ = gl.policy_loss(new, behaviour, adv, mask, 4, ref_logprobs=ref, kl_coef=0.5)
    assert loss_kl.item() == pytest.approx((10 + 0.5 * 0.5) / 4)  # k3 sum is 0.5


def test_ppo_clip_stats_and_loss_on_the_hand_case():
    new, behaviour, _, mask, adv = _hand_case()
    loss, s = gl.policy_loss(new, behaviour, adv, mask, 4, loss_type="ppo_clip", clip_eps=0.2)
    assert s["ratio/clipfrac"].item() == pytest.approx(2 / 3)  # 2 and 8 are outside [0.8, 1.2]
    assert "kl/ref" not in s
    # min(1, 1) + min(2, 1.2) * 1 + min(8 * 2, 1.2 * 2) = 1 + 1.2 + 2.4 = 4.6
    assert loss.item() == pytest.approx(-4.6 / 4)
