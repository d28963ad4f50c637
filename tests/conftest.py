"""Every test runs offline, with caches and logs in a temporary folder."""

import os
import tempfile

_root = tempfile.mkdtemp(prefix="lmhpd-tests-")
os.environ.update(
    HF_HUB_OFFLINE="1",
    HF_DATASETS_OFFLINE="1",
    HF_HOME=os.path.join(_root, "hf"),
    WANDB_DIR=os.path.join(_root, "wandb"),
    WANDB_MODE="offline",
    WANDB_SILENT="true",
    MPLCONFIGDIR=os.path.join(_root, "matplotlib"),
    LMHPD_CACHE=os.path.join(_root, "assets"),
    TF_CPP_MIN_LOG_LEVEL="3",
    TOKENIZERS_PARALLELISM="false",
)
os.environ.pop("WANDB_API_KEY", None)
