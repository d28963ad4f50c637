"""AdamTensorFlowStyle against TensorFlow's own `tf.compat.v1.train.AdamOptimizer`.

OAI trains with `tf.train.AdamOptimizer(lr, epsilon=1e-5)` (# OAI: lm_human_preferences/utils/core.py#L621-L629).
The TF optimizer runs in graph mode inside its own `tf.Graph`, so TensorFlow's global eager mode is untouched.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow: errors only

import numpy as np
import pytest
import tensorflow as tf
import torch

from lm_human_preference_details.optim import AdamTensorFlowStyle

tf1 = tf.compat.v1

LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-5
SHAPES = [(3, 4), (5,), (2, 3, 2)]  # several parameter tensors of different ranks


def tf_adam_trajectory(init, grad_fn, steps, lr=LR, betas=BETAS, eps=EPS, dtype=np.float32):
    """Parameters after each of `steps` TF1 Adam steps; `grad_fn(step, params) -> grads` (NumPy)."""
    graph = tf.Graph()
    with graph.as_default():
        variables = [tf1.Variable(x.astype(dtype)) for x in init]
        grads = [tf1.placeholder(dtype, x.shape) for x in init]
        optimizer = tf1.train.AdamOptimizer(lr, beta1=betas[0], beta2=betas[1], epsilon=eps)
        train_op = optimizer.apply_gradients(list(zip(grads, variables)))
        with tf1.Session(graph=graph) as sess:
            sess.run(tf1.global_variables_initializer())
            trajectory = []
            for step in range(steps):
                params = sess.run(variables)
                sess.run(train_op, feed_dict=dict(zip(grads, grad_fn(step, params))))
                trajectory.append(sess.run(variables))
    return trajectory


def torch_trajectory(optimizer_cls, init, grad_fn, steps, dtype=torch.float32, **kwargs):
    params = [torch.nn.Parameter(torch.tensor(x, dtype=dtype)) for x in init]
    optimizer = optimizer_cls(params, **kwargs)
    trajectory = []
    for step in range(steps):
        grads = grad_fn(step, [p.detach().numpy().copy() for p in params])
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g, dtype=dtype)
        optimizer.step()
        trajectory.append([p.detach().numpy().copy() for p in params])
    return trajectory


def random_gradients(seed, steps, scales=(1e-4, 1e-2, 1.0)):
    """Gradients fixed in advance, each tensor at its own scale (small ones are where eps matters)."""
    rng = np.random.default_rng(seed)
    table = [
        [(rng.standard_normal(s) * scale).astype(np.float32) for s, scale in zip(SHAPES, scales)] for _ in range(steps)
    ]
    return lambda step, params: table[step]


def quadratic_gradients(seed):
    """Gradient of sum_i 0.5 * a_i * (p_i - c_i)^2, evaluated at the current parameters."""
    rng = np.random.default_rng(seed)
    a = [rng.uniform(0.01, 2.0, s).astype(np.float32) for s in SHAPES]
    c = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    return lambda step, params: [(ai * (p - ci)).astype(np.float32) for ai, p, ci in zip(a, params, c)]


def initial_params(seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


@pytest.mark.parametrize("problem", ["random_gradients", "quadratic"])
def test_matches_tf1_adam_float32(problem):
    steps = 20
    grad_fn = random_gradients(1, steps) if problem == "random_gradients" else quadratic_gradients(1)
    init = initial_params(0)
    expected = tf_adam_trajectory(init, grad_fn, steps)
    actual = torch_trajectory(AdamTensorFlowStyle, init, grad_fn, steps, lr=LR, betas=BETAS, eps=EPS)
    moved = max(np.abs(e - x).max() for e, x in zip(expected[-1], init))
    assert moved > 5e-3  # the parameters did move, so agreement is not trivial
    for step, (e_params, a_params) in enumerate(zip(expected, actual)):
        for e, a in zip(e_params, a_params):
            np.testing.assert_allclose(a, e, rtol=0, atol=1e-6, err_msg=f"step {step + 1}")


def test_matches_tf1_adam_other_hyperparameters():
    """Non-default betas, eps and lr: each must reach the update the same way TF uses it."""
    steps = 12
    grad_fn = random_gradients(2, steps, scales=(1e-3, 1e-1, 1.0))
    init = initial_params(3)
    hp = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-3)
    expected = tf_adam_trajectory(init, grad_fn, steps, **hp)
    actual = torch_trajectory(AdamTensorFlowStyle, init, grad_fn, steps, **hp)
    for e_params, a_params in zip(expected, actual):
        for e, a in zip(e_params, a_params):
            np.testing.assert_allclose(a, e, rtol=0, atol=1e-6)


def test_first_step_closed_form_and_torch_adam_differs():
    """REFERENCE detail 19: with gradients ~1e-4 and eps=1e-5, torch.optim.Adam's first step is several times larger."""
    g = np.full((4,), 1e-4, dtype=np.float64)
    grad_fn = lambda step, params: [g]  # noqa: E731
    init = [np.zeros(4)]
    tf_step = tf_adam_trajectory(init, grad_fn, 1, dtype=np.float64)[0][0]
    ours = torch_trajectory(AdamTensorFlowStyle, init, grad_fn, 1, dtype=torch.float64, lr=LR, betas=BETAS, eps=EPS)[0][
        0
    ]
    theirs = torch_trajectory(torch.optim.Adam, init, grad_fn, 1, dtype=torch.float64, lr=LR, betas=BETAS, eps=EPS)[0][
        0
    ]

    # TF1: lr * sqrt(1 - b2) / (1 - b1) * m / (sqrt(v) + eps), m = (1 - b1) g, v = (1 - b2) g^2
    b1, b2 = BETAS
    closed_form = -LR * np.sqrt(1 - b2) / (1 - b1) * (1 - b1) * g / (np.sqrt(1 - b2) * g + EPS)
    np.testing.assert_allclose(ours, closed_form, rtol=1e-12)
    # TF1 keeps lr, betas, eps and the beta powers in float32 even for float64 variables: float32's rounding
    np.testing.assert_allclose(ours, tf_step, rtol=2e-5)
    np.testing.assert_allclose(theirs, -LR * g / (g + EPS), rtol=1e-12)  # torch: eps added after bias correction
    ratio = np.abs(theirs).max() / np.abs(ours).max()
    assert ratio > 3.5, ratio  # about 3.8x here, and it grows as the gradients shrink

    # the gap closes once gradients dwarf eps: both take a step of about lr
    big = [np.full((4,), 1.0)]
    ours_big = torch_trajectory(AdamTensorFlowStyle, init, lambda s, p: big, 1, dtype=torch.float64, lr=LR, eps=EPS)[0][
        0
    ]
    theirs_big = torch_trajectory(torch.optim.Adam, init, lambda s, p: big, 1, dtype=torch.float64, lr=LR, eps=EPS)[0][
        0
    ]
    np.testing.assert_allclose(ours_big, theirs_big, rtol=1e-3)


def test_torch_adam_trajectory_does_not_match_tf1():
    """The same comparison that AdamTensorFlowStyle passes fails for torch.optim.Adam."""
    steps = 10
    grad_fn = random_gradients(4, steps)
    init = initial_params(5)
    expected = tf_adam_trajectory(init, grad_fn, steps)
    theirs = torch_trajectory(torch.optim.Adam, init, grad_fn, steps, lr=LR, betas=BETAS, eps=EPS)
    assert max(np.abs(e - a).max() for e, a in zip(expected[-1], theirs[-1])) > 1e-3


def test_skips_parameters_without_gradient():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    optimizer = AdamTensorFlowStyle([a, b], lr=LR)
    a.grad = torch.ones(3)
    optimizer.step()
    assert torch.equal(b.detach(), torch.ones(3))
    assert not torch.equal(a.detach(), torch.ones(3))
    assert b not in optimizer.state or not optimizer.state[b]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(lr=-1e-3), "lr"),
        (dict(betas=(1.0, 0.999)), "betas"),
        (dict(betas=(0.9, -0.1)), "betas"),
        (dict(betas=(-0.1, 0.999)), "betas"),
        (dict(betas=(0.9, 1.5)), "betas"),
        (dict(eps=-1e-8), "eps"),
    ],
)
def test_constructor_rejects_bad_hyperparameters(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AdamTensorFlowStyle([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_constructor_accepts_edge_values():
    AdamTensorFlowStyle([torch.nn.Parameter(torch.zeros(2))], lr=0.0, betas=(0.0, 0.0), eps=0.0)
