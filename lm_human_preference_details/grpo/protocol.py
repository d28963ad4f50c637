"""The constants and small types of the contract between the GRPO inference servers and those who talk to
them (trainer, actor, launcher, benchmarks): docs/DESIGN.md's "The GRPO pipeline contract", in one place, with
the check a server makes of an update's parameters (`mismatches`).

Plain Python, no torch: the client side of the contract (`grpo.client`) and the launcher import it.
"""

import ipaddress
import socket
from dataclasses import dataclass
from typing import Literal

MAX_CHOICES = 512
"""sequences one completion request may ask for (prompts x n)"""

MIN_TEMPERATURE = 1e-4
"""the lowest sampling temperature a server takes: logits / temperature must stay finite in float32 (1e-50 is
0 there, and every sequence of the batch would get NaN probabilities)"""

TOKEN_ENV = "GRPO_SERVER_TOKEN"
"""the environment variable that holds the control token /init_process_group and /request_weight_update require
of a server that has one (the launcher sets it for the servers and the trainer it starts; `grpo.client` sends it):
not a flag, which every user of the machine could read in `ps`"""

WIRE_DTYPES = ("float32", "bfloat16", "float16")
"""the dtype names a weight update's parameters and /health's `dtype` are given in (torch's names)"""

ServerDtype = Literal["auto", "float32", "bfloat16"]
"""the precision of a server's weights (the server's `--dtype`, the launcher's `--server-dtype`, which says why)"""

WeightBackend = Literal["gloo", "nccl"]
"""how weight updates travel (/init_process_group's `backend`; the launcher's `--weight-backend` says when each)"""

WeightStaging = Literal["staged", "in_place"]
"""how a server swaps a received update in (the servers' `--weight-staging`, the launcher's `--weight-staging`):
`staged` readies the new weights beside the old ones and the pause only swaps them, `in_place` loads into the
model's own tensors during the pause (a prepared copy less of memory, on engines that prepare one)"""


@dataclass(frozen=True)
class ParameterSpec:
    """One tensor of a weight update, as /request_weight_update announces it: `{name, shape, dtype}`."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """one of WIRE_DTYPES"""

    @classmethod
    def from_json(cls, record: dict) -> "ParameterSpec":
        return cls(str(record["name"]), tuple(int(d) for d in record["shape"]), str(record["dtype"]))

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


def mismatches(expected: list[ParameterSpec], offered: list[ParameterSpec]) -> list[str]:
    """Why `offered` cannot be loaded into a model whose parameters are `expected` ([] if it can)."""
    want = {s.name: s for s in expected}
    have = {s.name: s for s in offered}
    reasons = [f"missing parameter {name}" for name in want if name not in have]
    reasons += [f"unknown parameter {name}" for name in have if name not in want]
    for name in want.keys() & have.keys():
        if want[name].shape != have[name].shape:
            reasons.append(f"{name}: shape {list(have[name].shape)}, the server's is {list(want[name].shape)}")
        if want[name].dtype != have[name].dtype:
            reasons.append(f"{name}: dtype {have[name].dtype}, the server's is {want[name].dtype}")
    if len(offered) != len(have):
        reasons.append("a parameter name is repeated")
    return sorted(reasons)


def is_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is loopback: a server there, or a store, serves this machine only."""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False
