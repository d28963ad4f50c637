"""The names of the GRPO loss's options, in one place: `grpo/loss.py` implements them and `grpo/config.py` offers
them as flags. No torch here: the launcher imports the config, and no torch."""

from typing import Literal

LossType = Literal["reinforce", "ppo_clip", "gspo"]
ImportanceSampling = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
Normalizer = Literal["sequences", "sequence_mean", "tokens", "max_tokens", "group_tokens"]
Baseline = Literal["mean", "leave_one_out"]
StdOver = Literal["group", "batch"]
