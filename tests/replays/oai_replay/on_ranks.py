"""The port's replays of OpenAI's runs under `mpirun`, in each process of `accelerate launch`: `on_ranks.py IN OUT`.

IN is a pickle of a list of `RanksJob`s; process r replays rank r's record of each and writes OUT.r, a pickle of one
result per job: the parameters (OAI's names) after every update, the metrics (and for stage 1 the parameters after
normalizing at the end). Not a test itself: tests/replays/test_oai_replay.py launches it (`replay.replay_on_ranks`).
"""

import contextlib
import pickle
import sys
from unittest import mock

import torch

from lm_human_preference_details import cli, ppo, sharding
from tests.replays.oai_replay.replay import RanksJob, replay_policy, replay_reward


@contextlib.contextmanager
def whitening_over_all_processes(accelerator):
    """The control's flipped choice: each minibatch whitened over the rows of all processes together, where OAI
    whitens each rank's own (# OAI: lm_human_preferences/train_policy.py#L324-L339)."""
    whiten = ppo.whiten

    def whiten_all(values: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
        mine = slice(accelerator.process_index * len(values), (accelerator.process_index + 1) * len(values))
        return whiten(accelerator.gather(values), shift_mean)[mine]

    with mock.patch.object(ppo, "whiten", whiten_all):
        yield


@cli.main_with_user_errors  # as the stages' own entry points: the process group ends before the interpreter does
def main() -> None:
    in_path, out_path = sys.argv[1:]
    torch.set_num_threads(1)  # the test model's matrices are tiny (tests/replays/test_oai_replay.py `one_thread`)
    accelerator = sharding.make_accelerator()
    with open(in_path, "rb") as f:
        jobs: list[RanksJob] = pickle.load(f)
    results = []
    for job in jobs:
        record = job.records[accelerator.process_index]
        if job.prepared.shape.reward is not None:
            results.append(replay_reward(job.prepared, record, job.output_dir, accelerator))
            continue
        flipped = whitening_over_all_processes(accelerator) if job.whiten_over_all else contextlib.nullcontext()
        with flipped:
            results.append(replay_policy(job.prepared, record, job.output_dir, accelerator))
    with open(f"{out_path}.{accelerator.process_index}", "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main()
    cli.exit_finished_rank()
