#!/usr/bin/env bash
# The speed tables of ppo_speed.py, grpo_speed.py and weight_sync.py (the home engine's rows) on a lent GPU
# machine, in one prepared run of about 7 minutes, written to $OUT: each table's results.md and results.json,
# the world map of a short GRPO launch (world_map/results.json; its summary line is in the log), and this
# run's log.
#
# Here, once:  bash benchmarks/gpu_wheels.sh       # what the GPU image lacks, as wheels in .whl/
# Then, with the device tool:  run(command="bash benchmarks/gpu.sh", carry=[".whl"], timeout_s=480)
#
# The GPU image has torch, accelerate and aiohttp (and a transformers older than 5.24); the rest comes
# from .whl/ into /tmp (nothing is downloaded there; the tiny models are made on the spot, before the
# clocks start). TRL rows come from .whl/trl112 and .whl/trl116, each installed in a directory of its
# own, or from $LMHPD_TRL_PYTHON and $LMHPD_TRL116_PYTHON where those are set (as tests/run.sh sets them);
# without either they are left out. SmolLM2's weight update is not timed: its GGUF package is too large
# to carry. The weight update's limit is gloo's: NCCL's would need a second GPU (it refuses two ranks on one). Each table is saved after every run, so one that overruns its time limit keeps its rows.
#
# DEVICE=cpu runs the same script without a GPU; SMOKE=1 shrinks every size to seconds; WHEELS=DIR
# installs from DIR instead of .whl/ (the test runs it with DEVICE=cpu SMOKE=1 and no wheels).
set -euo pipefail
mkdir -p "${OUT:-runs/gpu}"
out=$(cd "${OUT:-runs/gpu}" && pwd)  # before the cd below: a relative OUT is relative to where it was started
cd "$(dirname "$0")/.."
device=${DEVICE:-cuda}
exec > >(tee "$out/gpu_sh.log") 2>&1
tee_pid=$!
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

wheels=${WHEELS:-.whl}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d "$wheels" ]; then
    rm -rf /tmp/lmhpd-site /tmp/lmhpd-trl112 /tmp/lmhpd-trl116  # nothing left from an earlier run
    install() {  # TARGET WHEELS...
        local target=$1; shift
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$target" "$@"
    }
    install /tmp/lmhpd-site "$wheels"/*.whl
    export PYTHONPATH="/tmp/lmhpd-site:$PYTHONPATH"
    for version in 112 116; do
        [ -d "$wheels/trl$version" ] || continue
        install /tmp/lmhpd-trl$version "$wheels/trl$version"/*.whl
        # a python that sees this TRL before everything else (--trl-python takes an executable)
        printf '#!/bin/sh\nPYTHONPATH=/tmp/lmhpd-trl%s:$PYTHONPATH exec python3 "$@"\n' $version > /tmp/lmhpd-trl$version/python
        chmod +x /tmp/lmhpd-trl$version/python
    done
    [ -d "$wheels/trl112" ] && export LMHPD_TRL_PYTHON=/tmp/lmhpd-trl112/python
    [ -d "$wheels/trl116" ] && export LMHPD_TRL116_PYTHON=/tmp/lmhpd-trl116/python
fi
git log -1 --format='commit %h %s' 2>/dev/null || true

# fail in seconds, not minutes into the budget: the device, the versions, the imports, the models
python3 - "$device" <<'EOF'
import sys

import torch
import transformers
from packaging.version import Version

device = sys.argv[1]
print("torch", torch.__version__, "| transformers", transformers.__version__, "| cuda:", torch.cuda.is_available() and torch.cuda.get_device_name())
assert device == "cpu" or torch.cuda.is_available(), "DEVICE=cuda and torch sees no GPU"
assert Version(transformers.__version__) >= Version("5.24"), "transformers < 5.24 comes first on the path: the wheels are not installed"
import aiohttp, math_verify, tyro  # noqa: E401,F401  the GRPO servers, rewards and every command line

from lm_human_preference_details.assets import resolve_model_path

for model in ("tiny", "tiny-math"):  # made on first use (tiny-math trains for a while): not inside a timed run
    print(model, resolve_model_path(model))
EOF
for trl_python in ${LMHPD_TRL_PYTHON:-} ${LMHPD_TRL116_PYTHON:-}; do
    "$trl_python" -c "import datasets, trl; print('trl', trl.__version__, '| datasets', datasets.__version__)"
done

trl=${LMHPD_TRL_PYTHON:+--trl-python $LMHPD_TRL_PYTHON}
trl116=${LMHPD_TRL116_PYTHON:+--trl-python $LMHPD_TRL116_PYTHON}
if [ "${SMOKE:-0}" = 1 ]; then
    ppo=(--batch-size 8 --query-length 16 --response-length 8 --epochs 1 --warmup 1 --updates 1 --repeats 1
         --scaling --scaling-batches 8 --scaling-lengths 8)
    limits=(600 600 300)  # a busy 2-core machine, not the GPU's time budget
    # every table grpo_speed makes, and every kind of row but two flag variants of a launch (per-tensor
    # updates, one thread per process: tests/grpo/test_launch.py runs those): the suite's smoke test of it
    grpo=(--steps 8 --repeats 1 --sync-steps 4 --pipeline-steps-ahead 2.5 --no-per-tensor-row --no-one-thread-row
          --scaling --scaling-batches 16 --scaling-tokens 3 --scaling-steps 5 -- --max-tokens 4)
    sync=(--updates 1 --raw-repeats 1 --dtypes float32 --stagings staged in_place --no-sharded-push)
else  # one process per row (a GPU run varies less than the 2-core CPU's)
    ppo=(--updates 10 --repeats 1 --scaling)
    grpo=(--steps 100 --repeats 1 --no-per-tensor-row --no-one-thread-row --pipeline-steps-ahead 2 6 -- --max-tokens 24 --ignore-eos)
    sync=(--updates 5 --dtypes bfloat16 float32 --stagings staged --no-sharded-push)  # FSDP2 needs a GPU a process
    limits=(150 180 60)  # seconds per table: with the setup, under the run's 480 s (the device's 15 minutes hold one such run, not two)
    # vLLM's rows where the GPU image has vLLM (too large to carry in .whl/): the image's python serves as the vLLM
    # environment (grpo/serving/vllm_env.py's layout; its server sees the image's packages, not .whl/'s newer
    # transformers),
    # weights go over gloo (the launcher's default: trainer and servers share the one GPU, where NCCL refuses two
    # ranks), and the GRPO table gets the time of the PPO table's shorter run
    if vllm_version=$(PYTHONPATH="$PWD" python3 -c "import vllm; print(vllm.__version__)" 2>/dev/null); then
        mkdir -p /tmp/lmhpd-vllm/bin && ln -sf "$(command -v python3)" /tmp/lmhpd-vllm/bin/python
        echo "vllm==$vllm_version" > /tmp/lmhpd-vllm/vllm_env_ready
        export LMHPD_VLLM_ENV=/tmp/lmhpd-vllm
        grpo=(--engines home vllm --generation-tasks tiny "${grpo[@]}")
        ppo=(--updates 5 --repeats 1 --scaling)
        limits=(100 210 60)
        echo "vLLM $vllm_version in the image: the GRPO table has its rows"
    else
        echo "no vLLM in the image: the GRPO table has the home engine's rows only"
    fi
fi
status=0
run_table() {  # NAME SECONDS COMMAND...: one table under its own time limit; on failure, its logs' last lines
    local name=$1 seconds=$2; shift 2
    if ! timeout -k 15 "$seconds" "$@"; then
        status=1
        echo "$name failed or ran out of its ${seconds} s; the last lines of its logs:"
        (find "$out/$name" \( -name '*.log' -o -name 'log.txt' \) -printf '%T@ %p\n' | sort -n | tail -n 6 | cut -d' ' -f2- \
            | xargs -r tail -n 25) 2>/dev/null || true  # the newest logs: those of the run that failed
    fi
}
run_table ppo_speed "${limits[0]}" python3 benchmarks/ppo_speed.py --device "$device" --out-dir "$out/ppo_speed" $trl "${ppo[@]}"
run_table grpo_speed "${limits[1]}" python3 benchmarks/grpo_speed.py --device "$device" --out-dir "$out/grpo_speed" \
    $trl116 "${grpo[@]}"
run_table weight_sync "${limits[2]}" python3 benchmarks/weight_sync.py --device "$device" --out-dir "$out/weight_sync" --models tiny-math \
    --engines home "${sync[@]}"
# the launcher's world map on this machine (grpo/world.py): with two GPUs or more, a server on GPU 0 and the trainer
# on GPU 1, weights over NCCL; with one, the colocated layout; on the CPU, two slots stand in for two GPUs
if [ "$device" = cpu ]; then
    layout=(--device cpu --gpus-per-node 2 --inference-gpus 1)
elif [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    layout=(--gpus-per-node 2 --inference-gpus 1)
else
    layout=()
fi
run_table world_map 120 python3 -m lm_human_preference_details.grpo.launch --task tiny --steps 10 --wandb-mode disabled \
    --output-dir "$out/world_map/run" "${layout[@]}"
[ -f "$out/world_map/run/world.json" ] && cp "$out/world_map/run/world.json" "$out/world_map/results.json"
# only the tables come back from the device machine ($OUT/a/b/file at most, 8 files): drop the runs
for name in ppo_speed grpo_speed weight_sync world_map; do
    [ -d "$out/$name" ] && find "$out/$name" -mindepth 1 -maxdepth 1 ! -name 'results.*' -exec rm -rf {} +
done
ls -R "$out"
echo "gpu.sh done in ${SECONDS} s, exit status $status"
exec >&- 2>&-
wait "$tee_pid" || true
exit $status
