"""Adam with TensorFlow 1's epsilon placement.

OAI trains with `tf.train.AdamOptimizer(learning_rate, epsilon=1e-5)` in its `minimize`
(# OAI: lm_human_preferences/utils/core.py#L621-L629). TF1 folds the bias
correction into the step size and adds epsilon to the *uncorrected* sqrt(v):

    lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t)
    p   -= lr_t * m / (sqrt(v) + eps)

`torch.optim.Adam` instead divides by `sqrt(v / (1 - b2^t)) + eps`, i.e. it bias-corrects
before adding eps. Early in training sqrt(1 - b2^t) is small, so TF's eps is effectively
`eps / sqrt(1 - b2^t)` in torch's terms, 1 / sqrt(1 - b2) = 32 times larger at t=1 (b2 = 0.999): TF1 Adam takes smaller
first steps. With eps=1e-5 and small gradients (as in LM fine-tuning) the difference is
large (see the ablation in benchmarks/ and the "N implementation details" post).
"""

import math
from typing import Literal

import torch

OptimizerName = Literal["adam_tf", "adam_torch"]


class AdamTensorFlowStyle(torch.optim.Optimizer):
    """Adam exactly as `tf.compat.v1.train.AdamOptimizer` computes it (dense gradients)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-5):
        if lr < 0.0:
            raise ValueError(f"AdamTensorFlowStyle: lr must be >= 0, got {lr}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"AdamTensorFlowStyle: betas must be in [0, 1), got {betas}")
        if eps < 0.0:
            raise ValueError(f"AdamTensorFlowStyle: eps must be >= 0, got {eps}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            step_sizes = []
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                # the bias correction lives in the step size; eps is added to the uncorrected sqrt(v)
                step_sizes.append(-group["lr"] * math.sqrt(1 - beta2 ** state["step"]) / (1 - beta1 ** state["step"]))
            # each op once over all the parameters (torch.optim's foreach form): a loop over them would launch
            # every op once per parameter, hundreds of kernels a step for GPT-2 on a GPU
            grads = [p.grad for p in params]
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)  # m = b1*m + (1-b1)*g
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
            denominators = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_add_(denominators, group["eps"])
            torch._foreach_addcdiv_(params, exp_avgs, denominators, step_sizes)
        return loss


def make_optimizer(name: OptimizerName, params, lr: float, eps: float) -> torch.optim.Optimizer:
    """`adam_tf`: OAI's optimizer (the PPO stages' default); `adam_torch`: torch.optim.Adam (the PPO
    ablation, GRPO's default), fused on CPU and CUDA (on CPU torch's default is a Python loop over the
    parameters, slow for a small model's many small tensors). `params`: tensors, not param groups. A state
    loaded from a checkpoint of an unfused Adam keeps its `fused: None` (slower, the same numbers)."""
    if name == "adam_tf":
        return AdamTensorFlowStyle(params, lr=lr, eps=eps)
    params = list(params)
    return torch.optim.Adam(params, lr=lr, eps=eps, fused=all(p.device.type in ("cpu", "cuda") for p in params))
