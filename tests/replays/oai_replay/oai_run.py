"""Runs OpenAI's unmodified trainers and records what a replay needs: `python -m oai_replay.oai_run IN OUT`.

IN is a pickle of a list of runs, each a dict: `stage` (`policy`: `train_policy.train`, whose
`PPOTrainer.step()` runs every update; `reward`: `train_reward.train`, whose `RewardModelTrainer.train()`
runs), `model` (OAI's model HParams for its model named 'test', which skips checkpoints), `hparams` (the
stage's HParams, dotted keys) and `weights` (`{OAI variable name: array}`, loaded before the first update
over OAI's random initialization: the port's initial weights). Run from tests/, alone or as the ranks of
`mpirun`. Each rank writes `OUT.RANK`, a pickle of one record per run: the queries, the sampled responses and
the numpy permutations OAI drew on that rank, the label order rank 0 broadcast, its logged statistics and its
parameters after every update. Recording wraps OAI's functions from outside; none of its code changes.
"""

import contextlib
import pickle
import random
import sys

from oai_replay import shims


def trainable_values(session, prefix: str) -> dict:
    import tensorflow as tf

    variables = [v for v in tf.trainable_variables() if v.op.name.startswith(prefix)]
    return dict(zip([v.op.name for v in variables], session.run(variables)))


def load_weights(session, weights: dict) -> None:
    import tensorflow as tf

    by_name = {v.op.name: v for v in tf.global_variables()}
    initializers = [by_name[name].initializer for name in weights]
    # the initializers run again, fed the values: the graph is finalized by now; one run, as each costs a pruning
    session.run(initializers, {op.inputs[1]: value for op, value in zip(initializers, weights.values())})


def recorded(function, into: list):
    """`function`, appending each result to `into`."""

    def call(*args, **kwargs):
        into.append(function(*args, **kwargs))
        return into[-1]

    return call


class BroadcastsRecorded:
    """An MPI communicator whose `bcast` results are appended to `into` (mpi4py's own takes no new attributes)."""

    def __init__(self, comm, into: list):
        self.comm, self.into = comm, into

    def bcast(self, value, root=0):
        self.into.append(self.comm.bcast(value, root=root))
        return self.into[-1]

    def __getattr__(self, name):
        return getattr(self.comm, name)


@contextlib.contextmanager
def replaced(owner, name: str, value):
    """`owner.name` is `value` inside the block."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def train(stage, hparams: dict) -> None:
    """OAI's `train` of a stage module, its HParams set from dotted keys and validated as OAI's tests do."""
    stage_hparams = stage.HParams()
    stage_hparams.override_from_dict(hparams)
    stage_hparams.validate()
    stage.train(hparams=stage_hparams)


def run_policy(run: dict, record: dict) -> None:
    import tensorflow as tf
    from lm_human_preferences import train_policy

    step = train_policy.PPOTrainer.step
    queries, rollouts, stats = [], [], []

    def recorded_step(self):
        session = tf.get_default_session()
        if not record["updates"]:
            load_weights(session, run["weights"])
            self.sample_queries = recorded(self.sample_queries, queries)
            self.policy.respond = recorded(self.policy.respond, rollouts)
            self.record_step_stats = recorded(self.record_step_stats, stats)
        step(self)
        record["updates"].append(
            dict(
                queries=queries[-1],
                responses=rollouts[-1]["responses"],
                stats={k: float(v) for k, v in stats[-1][1].items()},
                params=trainable_values(session, "policy/"),
            )
        )

    with replaced(train_policy.PPOTrainer, "step", recorded_step):
        train(train_policy, run["hparams"])


def run_reward(run: dict, record: dict) -> None:
    import tensorflow as tf
    from lm_human_preferences import train_reward

    train_labels = train_reward.RewardModelTrainer.train
    record["normalize_samples"], record["normalize_stats"], record["label_orders"] = [], [], []

    def recorded_train(self):
        session = tf.get_default_session()
        load_weights(session, run["weights"])
        train_batch = self.train_batch

        def recorded_train_batch(indices, lr):
            train_batch(indices, lr)
            record["updates"].append(dict(params=trainable_values(session, "reward_model/")))

        self.train_batch = recorded_train_batch
        # the label order every rank trains in: rank 0's permutation, broadcast
        # OAI: lm_human_preferences/train_reward.py#L241
        self.comm = BroadcastsRecorded(self.comm, record["label_orders"])
        # one list of (queries, responses) batches per normalization
        self.sample_policy_responses = recorded(self.sample_policy_responses, record["normalize_samples"])
        self.stats = recorded(self.stats, record["normalize_stats"])
        train_labels(self)
        record["final_params"] = trainable_values(session, "reward_model/")

    with replaced(train_reward.RewardModelTrainer, "train", recorded_train):
        train(train_reward, run["hparams"])


def main(in_path: str, out_path: str) -> None:
    shims.install()
    import numpy as np
    from lm_human_preferences.language import model, trained_models
    from lm_human_preferences.utils import gcs
    from mpi4py import MPI

    gcs.download_file_cached = lambda path, comm=None: path  # the label files are local
    with open(in_path, "rb") as f:
        runs = pickle.load(f)
    permutations = []
    np.random.permutation = recorded(np.random.permutation, permutations)
    records = []
    for run in runs:
        trained_models.test_hparams = lambda run=run: model.HParams(**run["model"])
        random.seed(run["seed"])  # OAI's `test` query dataset draws its characters from Python's random
        record = {"updates": []}
        {"policy": run_policy, "reward": run_reward}[run["stage"]](run, record)
        record["permutations"], permutations[:] = list(permutations), []
        records.append(record)
    with open(f"{out_path}.{MPI.COMM_WORLD.Get_rank()}", "wb") as f:
        pickle.dump(records, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
