"""What OpenAI's 2019 TF1 code imports, under today's TensorFlow 2 and Python 3.11.

`install()` swaps `tensorflow` for `tf.compat.v1` process-wide, so it runs only in the OAI subprocess
(`tests/replays/oai_replay/oai_run.py`), never in pytest's. A process that `mpirun` started keeps the real mpi4py;
one started alone gets a one-rank stand-in (`OneRankComm`).
"""

import collections
import collections.abc
import os
import sys
import types

VENDORED = os.path.join(os.path.dirname(__file__), "..", "..", "..", "third_party", "lm_human_preferences")


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


class OneRankComm:
    """mpi4py's COMM_WORLD as one process sees it alone (what OAI calls of it)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def bcast(self, value, root=0):
        return value

    def allreduce(self, value, op=None):
        return value


def under_mpirun() -> bool:
    """Whether Open MPI's `mpirun` started this process as one of its ranks."""
    return "OMPI_COMM_WORLD_SIZE" in os.environ


def install() -> None:
    import tensorflow as tf2
    import typeguard
    from tensorflow.python.ops import summary_ops_v2
    from tensorflow.python.util import nest

    tf = tf2.compat.v1
    tf.disable_v2_behavior()
    tf.contrib = _module(
        "tensorflow.contrib",
        summary=summary_ops_v2,
        framework=types.SimpleNamespace(nest=nest, is_tensor=tf.is_tensor),
        # it only feeds a regularizer output that nothing reads
        # OAI: lm_human_preferences/language/model.py#L251-L254
        layers=types.SimpleNamespace(l2_regularizer=lambda scale: lambda w: scale * tf.nn.l2_loss(w)),
    )
    sys.modules["tensorflow.contrib.summary"] = summary_ops_v2
    sys.modules["tensorflow"] = tf
    collections.Mapping = collections.abc.Mapping  # removed in Python 3.10
    # OAI calls typeguard 2's check_type(name, value, type); typeguard 4 takes (value, type)
    check_type = typeguard.check_type
    _module("typeguard", check_type=lambda name, value, expected: check_type(value, expected))
    if not under_mpirun():
        mpi = types.SimpleNamespace(COMM_WORLD=OneRankComm(), SUM="sum")
        _module("mpi4py", MPI=mpi)
        _module("mpi4py.MPI", **vars(mpi))
    # utils/gcs.py imports Google Cloud's client at the top; nothing offline calls it
    _module("google.api_core.exceptions", InternalServerError=Exception, ServiceUnavailable=Exception)
    _module("google.cloud", storage=_module("google.cloud.storage"))
    sys.path.insert(0, os.path.abspath(VENDORED))
