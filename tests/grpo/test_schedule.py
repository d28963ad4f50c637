"""The GRPO schedule (`grpo/schedule.py`): what the trainer reads, when it pushes and saves, how far the actor runs
ahead. The actor's and the trainer's use of it: tests/test_grpo_engine.py and tests/test_grpo_trainer.py."""

import dataclasses

from lm_human_preference_details.grpo.config import get_preset
from lm_human_preference_details.grpo.schedule import Schedule

SYNC = Schedule(mode="sync", steps=4, sync_steps=3, steps_ahead=2, groups_per_step=2, request_problems=1)
PIPELINE = dataclasses.replace(SYNC, mode="pipeline")


def test_a_periodic_thing_is_due_at_multiples_of_its_interval_and_after_the_last_step():
    assert [v for v in range(1, 5) if SYNC.due(2, v)] == [2, 4]
    assert [v for v in range(1, 5) if SYNC.due(3, v)] == [3, 4]  # the last step too
    assert get_preset("tiny").run_schedule().due(0, 10) is False  # an interval of 0: never (--save-interval 0)


def test_evaluations_come_at_step_0_every_interval_and_the_last_and_a_resumed_run_does_those_from_its_start():
    tiny = get_preset("tiny").run_schedule()  # 100 steps
    assert tiny.evaluations(20, start=0) == [0, 20, 40, 60, 80, 100]
    assert tiny.evaluations(30, start=0) == [0, 30, 60, 90, 100]
    assert tiny.evaluations(30, start=60) == [60, 90, 100]  # step 60's came after its checkpoint: never logged
    assert tiny.evaluations(30, start=61) == [90, 100]
    assert tiny.evaluations(0, start=0) == []


def test_weights_go_out_after_every_step_or_every_round_and_after_the_last():
    assert [v for v in range(1, 5) if PIPELINE.push_due(v)] == [1, 2, 3, 4]
    assert [v for v in range(1, 5) if SYNC.push_due(v)] == [3, 4]


def test_the_trainer_reads_one_step_or_the_rest_of_the_round():
    assert [SYNC.groups_to_read(v) for v in range(4)] == [6, 4, 2, 2]
    assert [PIPELINE.groups_to_read(v) for v in range(4)] == [2, 2, 2, 2]


def test_the_actor_starts_problems_up_to_its_lookahead_or_to_the_rounds_end():
    assert PIPELINE.problems_ahead() == 4
    assert [PIPELINE.may_start(g, weights=1) for g in (5, 6)] == [True, False]  # 1 x 2 + 4 problems ahead
    assert [SYNC.may_start(g, weights=1) for g in (5, 6)] == [True, False]  # the round of steps 1-3
    assert (PIPELINE.server_lag_allowed(), SYNC.server_lag_allowed()) == (2, 0)
