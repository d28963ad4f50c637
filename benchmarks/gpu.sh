#!/usr/bin/env bash
# The speed tables of ppo_speed.py and grpo_speed.py on a lent GPU machine, in one prepared run of
# under 8 minutes, written to $OUT (each table's results.md and results.json, and this run's log).
#
# Here, once:  bash benchmarks/gpu_wheels.sh       # what the GPU image lacks, as wheels in .whl/
# Then, with the device tool:  run(command="bash benchmarks/gpu.sh", carry=[".whl"], timeout_s=540)
#
# The GPU image has torch, accelerate and aiohttp (and a transformers older than 5.24); the rest comes from .whl/ into
# /tmp (nothing is downloaded there, and the tiny models are made on the spot). TRL columns come from
# .whl/trl112 and .whl/trl116, each installed in a directory of its own, or from $LMHPD_TRL_PYTHON and
# $LMHPD_TRL116_PYTHON where those are set (as .ci/run sets them); without either the rows are left out.
# SmolLM2's weight update is not timed: its GGUF package is too large to carry.
#
# DEVICE=cpu runs the same script without a GPU; SMOKE=1 shrinks every size to seconds; WHEELS=DIR
# installs from DIR instead of .whl/ (the test runs it with DEVICE=cpu SMOKE=1 and no wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/gpu}
device=${DEVICE:-cuda}
mkdir -p "$out" && out=$(cd "$out" && pwd)
exec > >(tee "$out/gpu_sh.log") 2>&1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

wheels=${WHEELS:-.whl}
if [ -d "$wheels" ]; then
    install() {  # TARGET WHEELS...
        local target=$1; shift
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$@"
    }
    install /tmp/lmhpd-site "$wheels"/*.whl
    export PYTHONPATH="/tmp/lmhpd-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    for version in 112 116; do
        [ -d "$wheels/trl$version" ] || continue
        install /tmp/lmhpd-trl$version "$wheels/trl$version"/*.whl
        # a python that sees this TRL before everything else (--trl-python takes an executable)
        printf '#!/bin/sh\nPYTHONPATH=/tmp/lmhpd-trl%s:$PYTHONPATH exec python3 "$@"\n' $version > /tmp/lmhpd-trl$version/python
        chmod +x /tmp/lmhpd-trl$version/python
    done
    [ -x /tmp/lmhpd-trl112/python ] && export LMHPD_TRL_PYTHON=/tmp/lmhpd-trl112/python
    [ -x /tmp/lmhpd-trl116/python ] && export LMHPD_TRL116_PYTHON=/tmp/lmhpd-trl116/python
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
git log -1 --format='commit %h %s' 2>/dev/null || true

trl=${LMHPD_TRL_PYTHON:+--trl-python $LMHPD_TRL_PYTHON}
trl116=${LMHPD_TRL116_PYTHON:+--trl-python $LMHPD_TRL116_PYTHON}
if [ "${SMOKE:-0}" = 1 ]; then
    ppo=(--batch-size 8 --query-length 16 --response-length 8 --epochs 1 --warmup 1 --updates 1 --repeats 1)
    grpo=(--steps 6 --repeats 1 --sync-steps 4 --updates 2 --no-per-tensor-row --no-raw-row -- --max-tokens 4)
    scaling=(--scaling-batches 8 --scaling-lengths 8)
else  # one process per row (a GPU run varies less than the 2-core CPU's)
    ppo=(--updates 10 --repeats 1)
    grpo=(--steps 100 --repeats 1 --no-per-tensor-row -- --max-tokens 24 --ignore-eos)
    scaling=()
fi
# each table under a time limit of its own, so that one that overruns leaves the others; 470 s in all
timeout 150 python3 benchmarks/ppo_speed.py --device "$device" --out-dir "$out/ppo_speed" $trl "${ppo[@]}" || echo "ppo_speed failed: $?"
timeout 210 python3 benchmarks/grpo_speed.py --device "$device" --out-dir "$out/grpo_speed" --update-models tiny-math \
    $trl116 "${grpo[@]}" || echo "grpo_speed failed: $?"
# the scaling table last, in the time left (its main table repeats the first one's, without TRL; the
# reward model is the first one's)
mkdir -p "$out/ppo_speed_scaling" && ln -sfn "$out/ppo_speed/reward" "$out/ppo_speed_scaling/reward"
timeout $((SECONDS < 440 ? 470 - SECONDS : 30)) python3 benchmarks/ppo_speed.py --device "$device" --out-dir "$out/ppo_speed_scaling" --scaling \
    "${scaling[@]}" "${ppo[@]}" || echo "ppo_speed --scaling failed: $?"
# only the tables come back from the device machine ($OUT/a/b/file at most, 8 files): drop the runs
rm -f "$out/ppo_speed_scaling/reward"
find "$out" -mindepth 2 -maxdepth 2 -type d -exec rm -rf {} +
ls -R "$out"
[ -s "$out/ppo_speed/results.md" ] && [ -s "$out/grpo_speed/results.md" ]
