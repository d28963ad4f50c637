"""GRPOArgs for tests, set by flag name (`lr=...`), not through the sub-configs (`optim=OptimArgs(lr=...)`)."""

import copy
import dataclasses

from lm_human_preference_details.grpo.config import GRPOArgs


def grpo_args(base: GRPOArgs | None = None, **values) -> GRPOArgs:
    """A copy of `base` (default: `GRPOArgs()`) with `values` set, each on the sub-config that holds it (a flag is
    named as its field, and the names are unique: `GRPOArgs.flag_values`)."""
    args = copy.deepcopy(base or GRPOArgs())
    holders = [args, *(value for value in vars(args).values() if dataclasses.is_dataclass(value))]
    for name, value in values.items():
        holder = next((h for h in holders if name in {f.name for f in dataclasses.fields(h)}), None)
        if holder is None:
            raise TypeError(f"GRPOArgs has no field {name!r}")
        setattr(holder, name, value)
    return args
