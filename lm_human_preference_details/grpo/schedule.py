"""When things happen in a GRPO run: what the trainer reads before a step, when it pushes weights, when a
periodic thing is due, how far ahead of the servers' weights the actor starts problems and which servers it asks.

`pipeline`: the weights go out after every step and the actor runs `steps_ahead` steps ahead of them. `sync`: the
conventional schedule, rounds of `sync_steps` steps: the actor generates a round with frozen weights, the trainer
reads the whole round before its first step and pushes the weights at the round's end. (Imports no torch: the
launcher uses it through `GRPOArgs`.)
"""

import math
from dataclasses import dataclass
from typing import Literal

from lm_human_preference_details.cli import UserError

Mode = Literal["pipeline", "sync"]


@dataclass(frozen=True)
class Schedule:
    """A run's schedule, from its `GRPOArgs` (`GRPOArgs.run_schedule`)."""

    mode: Mode
    steps: int
    sync_steps: int
    steps_ahead: float
    groups_per_step: int  # problems (groups) of one optimizer step
    request_problems: int  # problems the actor sends in one request

    def due(self, interval: int, version: int) -> bool:
        """Whether what comes every `interval` steps (0: never) comes after step `version`: at its multiples,
        and after the last step."""
        return interval > 0 and (version % interval == 0 or version == self.steps)

    def evaluations(self, interval: int, start: int) -> list[int]:
        """The steps whose weights are evaluated every `interval` steps (0: none): step 0, its multiples and the last
        (`due`), from `start` on in a run resumed there (the checkpoint's own step too: its evaluation comes after the
        step's line, which the checkpoint follows, so the run that saved it never logged it)."""
        return [step for step in range(start, self.steps + 1) if self.due(interval, step)]

    def push_interval(self) -> int:
        """Optimizer steps between two weight pushes to the servers: every step in `pipeline`, every round in `sync`."""
        return 1 if self.mode == "pipeline" else self.sync_steps

    def push_due(self, version: int) -> bool:
        """Whether the trainer pushes weights `version` to the servers."""
        return self.due(self.push_interval(), version)

    def groups_to_read(self, version: int) -> int:
        """Groups the trainer reads from the stream before the step after `version`, when it has none left:
        `pipeline`, one step's; `sync`, the rest of the round (rounds end at multiples of `sync_steps`, where the
        weights go out: the conventional schedule trains only once the whole round is generated, and a run
        resumed mid-round reads the rest of it); never beyond `steps`."""
        steps = 1 if self.mode == "pipeline" else self.sync_steps - version % self.sync_steps
        return min(steps, self.steps - version) * self.groups_per_step

    def problems_ahead(self) -> int:
        """How many problems beyond the servers' weights the actor may start in `pipeline` mode: `steps_ahead`
        steps' (`sync` mode goes by rounds instead: `may_start`). A UserError when a fractional `steps_ahead` is
        no whole number of problems, or is one that the requests (`request_problems` problems each) cannot split."""
        problems = self.steps_ahead * self.groups_per_step
        if not math.isfinite(problems) or abs(problems - round(problems)) > 1e-6:
            raise UserError(
                f"--steps-ahead {self.steps_ahead!r} is {problems:.6g} problems ahead, not a whole number: pass a "
                f"multiple of 1/{self.groups_per_step} (the problems of a step, batch_size / group_size)"
            )
        problems = round(problems)
        if problems % self.request_problems:
            acts_as = problems // self.request_problems * self.request_problems / self.groups_per_step
            raise UserError(
                f"--steps-ahead {self.steps_ahead!r} starts {problems} problems ahead, which requests of "
                f"{self.request_problems} problems cannot split (it would act as {acts_as:g}): pass a "
                f"--problems-per-request that divides both {self.groups_per_step} and {problems}"
            )
        return problems

    def may_start(self, group_index: int, weights: int) -> bool:
        """Whether the actor may start group `group_index` while the servers' newest weights are version `weights`.
        `pipeline`: it belongs to one of the `steps_ahead` optimizer steps after those weights (a fractional
        lookahead: or to the first part of the step after those). `sync`: it belongs to the round that those weights
        begin (rounds end at multiples of `sync_steps`; a run resumed mid-round finishes that round first)."""
        if self.mode == "sync":
            round_end = (weights // self.sync_steps + 1) * self.sync_steps
            return group_index < round_end * self.groups_per_step
        return group_index < weights * self.groups_per_step + self.problems_ahead()

    def server_lag_allowed(self) -> float:
        """How many versions behind the newest weights a server may be and still get requests: `pipeline`,
        `steps_ahead` (further behind: a server the trainer stopped updating); `sync`, none (a round's samples all
        come from the weights the round began with, even while another server is still receiving)."""
        return self.steps_ahead if self.mode == "pipeline" else 0
