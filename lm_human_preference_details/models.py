"""Policy with a value head, and the reward model, over any transformers causal LM.

Every forward pass follows OAI's padding convention: the pad id (beyond the vocabulary) is
masked out of attention and replaced by 0 in `input_ids`, and positions count real tokens
only, so the amount of padding never changes the logits of real tokens.
Modules are kept in eval mode: OAI trains without dropout (# OAI: lm_human_preferences/policy.py#L48).
"""

import json
import os

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .assets import resolve_model_path, unknown_model


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Exclusive cumulative sum of the mask: the index of each token among the real tokens.

    Equals `tf.cumsum(mask, axis=1, exclusive=True)`.
    # OAI: lm_human_preferences/language/model.py#L265-L269
    # OAI: lm_human_preferences/language/model.py#L296-L297
    # OAI: lm_human_preferences/language/model.py#L320
    """
    return torch.cumsum(mask, dim=1) - mask


def masked_inputs(input_ids: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """The keyword arguments of a transformers forward pass for ids padded with `pad_id`."""
    mask = (input_ids != pad_id).long()
    return dict(
        input_ids=torch.where(mask.bool(), input_ids, torch.zeros_like(input_ids)),  # pad id is not in the embedding
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
    )


def last_real_index(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) mask -> (B,) index of the last real token of each row."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    return (mask * positions).argmax(dim=1)


def temperature_log_softmax(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """log softmax(logits / temperature) over the last axis (..., V): the distribution that the sampler, the servers'
    engine and both trainers read, so that a sampled token's logprob and its recomputation agree bitwise.

    Logits in a half precision are upcast to float32 first; float32 and float64 logits keep their dtype.
    `temperature`: a number, or a tensor that broadcasts against the logits (the engine's one per row).
    """
    # OAI: lm_human_preferences/policy.py#L121 (logits divided by the temperature everywhere)
    return (logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature).log_softmax(-1)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) at `tokens`: (B, T, V), (B, T) -> (B, T).

    Equivalent to `torch.gather((logits / temperature).log_softmax(-1), -1, tokens[..., None])[..., 0]`.
    """
    return torch.gather(temperature_log_softmax(logits, temperature), -1, tokens.unsqueeze(-1)).squeeze(-1)


def disable_dropout(model: nn.Module) -> nn.Module:
    """No dropout anywhere (# OAI: lm_human_preferences/policy.py#L48): eval mode, gradients still flow."""
    return model.eval()  # nothing in this project calls .train(); accelerate and DDP do not either


def scalar_head(hidden_size: int, std: float) -> nn.Linear:
    """A linear map to one number, weight N(0, std), bias 0 (OAI's `fc_layer`).

    # OAI: lm_human_preferences/language/model.py#L248-L254
    """
    head = nn.Linear(hidden_size, 1)
    nn.init.normal_(head.weight, std=std)
    nn.init.zeros_(head.bias)
    return head


def pretrained_config(path: str):
    """A model folder's config, with GPT-2's activation as torch's one fused kernel.

    GPT-2 computes GELU by its tanh approximation (# OAI: lm_human_preferences/language/model.py#L35-L37);
    transformers' `gelu_new` spells it out in seven elementwise ops, `gelu_pytorch_tanh` is the same
    function (equal within float32 rounding) in one kernel: a small model's step on a CPU spends much of
    its time in such elementwise passes over its activations.
    """
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "activation_function", None) == "gelu_new":
        config.activation_function = "gelu_pytorch_tanh"
    return config


def load_causal_lm(name_or_path: str) -> nn.Module:
    path = resolve_model_path(name_or_path)
    try:
        return disable_dropout(
            AutoModelForCausalLM.from_pretrained(path, config=pretrained_config(path), dtype=torch.float32)
        )
    except OSError as error:
        raise unknown_model(name_or_path, error) from error


class PolicyAndValue(nn.Module):
    """A causal LM and a value head on its final hidden states (shared trunk).

    One model with a scalar head `value`, which starts at zero (`scale=0 if head_name == 'value'`).
    # OAI: lm_human_preferences/policy.py#L26-L28
    # OAI: lm_human_preferences/language/model.py#L368
    """

    VALUE_HEAD_FILE = "value_head.safetensors"

    def __init__(self, lm: nn.Module, vocab_size: int | None = None):
        super().__init__()
        self.lm = lm
        # logits beyond the tokenizer's ids are dropped: # OAI: lm_human_preferences/policy.py#L59
        self.vocab_size = vocab_size
        self.value_head = scalar_head(lm.config.hidden_size, std=0.0)
        self._no_split_modules = getattr(lm, "_no_split_modules", None)  # FSDP's shard groups: the LM's blocks
        disable_dropout(self)

    def forward(
        self, input_ids: torch.Tensor, pad_id: int, positions: slice = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) ids -> logits (B, T', V) and values (B, T') at `positions` (default: all T).

        Only those positions go through the output layer, whose cost and memory grow with the
        positions it sees: of a PPO batch's query + response, the responses are predicted from the
        last query position through the second-to-last position, and the other query positions
        predict nothing used (a large vocabulary makes the output layer a large share of the forward).
        """
        hidden = self.lm.base_model(**masked_inputs(input_ids, pad_id)).last_hidden_state[:, positions]  # (B, T', H)
        logits = self.lm.get_output_embeddings()(hidden)[..., : self.vocab_size]  # (B, T', V)
        return logits, self.value_head(hidden).squeeze(-1).float()  # float32 under autocast too, as OAI computes it

    def sample(self, sample_fn, *args, **kwargs):
        """`sample_fn(self.lm, *args, **kwargs)` (a rollout: `sampling.sample_responses`) as a method of the model,
        so that a sharding engine gathers the parameters around it as around `forward` (`sharding.prepare`)."""
        return sample_fn(self.lm, *args, **kwargs)

    def save(self, path: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """A folder: the LM as `save_pretrained` writes it (`load_causal_lm` reads it), the value head beside it.
        `state_dict`: the model's whole tensors, when its own are shards (`sharding.full_state_dict`)."""
        state_dict = self.state_dict() if state_dict is None else state_dict
        # a tied weight once, under the name the LM keeps (gathered whole tensors no longer share their memory)
        tied = {n for n, _ in self.lm.named_parameters(remove_duplicate=False)} - dict(
            self.lm.named_parameters()
        ).keys()
        lm_state = {k.removeprefix("lm."): v for k, v in state_dict.items() if k.startswith("lm.")}
        self.lm.save_pretrained(path, state_dict={k: v for k, v in lm_state.items() if k not in tied})
        head = {k.removeprefix("value_head."): v for k, v in state_dict.items() if k.startswith("value_head.")}
        save_file({k: v.detach().contiguous() for k, v in head.items()}, os.path.join(path, self.VALUE_HEAD_FILE))


class RewardModel(nn.Module):
    """reward = gain * head(h_last) + bias, on the LM trunk's final hidden state of the last token.

    # OAI: lm_human_preferences/rewards.py#L43-L61 (head on the last token, gain and bias)
    # OAI: lm_human_preferences/rewards.py#L69-L71 (gain and bias are trained with the rest)
    """

    HEAD_FILE = "reward_head.safetensors"
    META_FILE = "reward_model.json"

    def __init__(self, backbone: nn.Module, base_model: str):
        super().__init__()
        self.backbone = backbone
        self.base_model_name = base_model
        d = backbone.config.hidden_size
        self.head = scalar_head(d, std=1 / (d + 1) ** 0.5)  # OAI: lm_human_preferences/language/model.py#L248-L254
        # OAI: lm_human_preferences/rewards.py#L50-L51 (gain 1, bias 0); OAI's are scalars, these of shape (1,), the
        # same numbers: a sharding engine splits parameters along their first dimension, which a scalar lacks
        self.gain = nn.Parameter(torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(1))
        self._no_split_modules = getattr(backbone, "_no_split_modules", None)  # FSDP's shard groups: the blocks
        disable_dropout(self)

    @classmethod
    def from_pretrained_lm(cls, name_or_path: str) -> "RewardModel":
        """A new reward head on a pretrained LM's trunk (OAI starts the reward model from the policy's LM)."""
        path = resolve_model_path(name_or_path)
        try:
            backbone = AutoModel.from_pretrained(path, config=pretrained_config(path), dtype=torch.float32)
        except OSError as error:
            raise unknown_model(name_or_path, error) from error
        return cls(backbone, base_model=name_or_path)

    def forward(self, query_responses: torch.Tensor, pad_id: int) -> torch.Tensor:
        """(B, T) ids -> (B,) rewards, read at the last position (# OAI: lm_human_preferences/rewards.py#L47).

        OAI's model gives a pad position the output of the last real token before it
        (# OAI: lm_human_preferences/language/model.py#L334-L340), so a truncated response, which ends
        in pads, is scored at its last real token.
        """
        inputs = masked_inputs(query_responses, pad_id)
        hidden = self.backbone(**inputs).last_hidden_state  # (B, T, H)
        last_real = last_real_index(inputs["attention_mask"])  # (B,)
        h_last = hidden[torch.arange(len(hidden), device=hidden.device), last_real]  # (B, H)
        return self.gain * self.head(h_last).squeeze(-1) + self.bias

    @torch.no_grad()
    def set_reward_norm(self, old_mean: float, old_std: float, new_mean: float = 0.0, new_std: float = 1.0) -> None:
        """Set gain and bias so that rewards distributed N(old_mean, old_std) become N(new_mean, new_std).

        Expects gain 1 and bias 0 (call `reset_reward_scale` first).
        # OAI: lm_human_preferences/rewards.py#L77-L89
        """
        gain, bias = self.gain_and_bias()
        if gain != 1.0 or bias != 0.0:
            raise RuntimeError(f"set_reward_norm expects gain 1 and bias 0, not {gain}, {bias}")
        gain = new_std / old_std
        self.gain.fill_(gain)
        self.bias.fill_(new_mean - gain * old_mean)

    def gain_and_bias(self) -> tuple[float, float]:
        """The gain and bias as numbers; a sharded model's are gathered (every process calls this then)."""

        def whole(parameter: torch.Tensor) -> torch.Tensor:
            return parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter  # a DTensor's shards

        return whole(self.gain).item(), whole(self.bias).item()

    @torch.no_grad()
    def reset_reward_scale(self) -> None:
        self.gain.fill_(1.0)
        self.bias.fill_(0.0)

    def save(self, path: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """A folder: the trunk as `save_pretrained` writes it, the head, gain and bias beside it.
        `state_dict`: the model's whole tensors, when its own are shards (`sharding.full_state_dict`)."""
        os.makedirs(path, exist_ok=True)
        state_dict = self.state_dict() if state_dict is None else state_dict
        trunk = {k.removeprefix("backbone."): v for k, v in state_dict.items() if k.startswith("backbone.")}
        self.backbone.save_pretrained(path, state_dict=trunk)
        head = {k: state_dict[k] for k in ("head.weight", "head.bias", "gain", "bias")}
        save_file({k: v.detach().contiguous() for k, v in head.items()}, os.path.join(path, self.HEAD_FILE))
        with open(os.path.join(path, self.META_FILE), "w") as f:
            json.dump({"base_model": self.base_model_name}, f)

    @classmethod
    def load(cls, path: str) -> "RewardModel":
        if not os.path.exists(os.path.join(path, cls.HEAD_FILE)):
            raise FileNotFoundError(
                f"{path} is not a reward model folder (no {cls.HEAD_FILE}); train one with train_reward.py"
            )
        with open(os.path.join(path, cls.META_FILE)) as f:
            meta = json.load(f)
        backbone = AutoModel.from_pretrained(path, config=pretrained_config(path), dtype=torch.float32)
        model = cls(backbone, base_model=meta["base_model"])
        head = load_file(os.path.join(path, cls.HEAD_FILE))
        with torch.no_grad():
            model.head.weight.copy_(head["head.weight"])
            model.head.bias.copy_(head["head.bias"])
            model.gain.copy_(head["gain"].reshape(1))  # a folder saved before they had shape (1,) holds scalars
            model.bias.copy_(head["bias"].reshape(1))
        return model
