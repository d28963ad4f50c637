#!/usr/bin/env bash
# Fetch, on a machine with PyPI, the wheels that benchmarks/gpu.sh installs on the lent GPU machine,
# whose image has torch, transformers, accelerate, aiohttp, pandas and pyarrow but not the rest of this
# project's needs, and which reaches no package registry. They go to .whl/ (ignored by git, carried
# with the device tool's `carry: [".whl"]`, about 17 MiB): this project's missing dependencies in .whl/,
# TRL 1.12.0 (PPO) in .whl/trl112/ and TRL 1.16.0 (GRPO) in .whl/trl116/.
#
#   bash benchmarks/gpu_wheels.sh            # for the GPU image's Python 3.12
#   PYTHON_VERSION=3.11 WHEELS=/tmp/wheels311 bash benchmarks/gpu_wheels.sh   # another Python, elsewhere
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=${PYTHON_VERSION:-3.12}
wheels=${WHEELS:-.whl}
download() {  # DIR PACKAGE==VERSION...: pure-Python wheels (multiprocess ships one per Python version)
    local dir=$1; shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$@"
}
rm -rf "$wheels"
# the command lines (tyro), TRL's data sets (datasets), the GRPO math reward (math-verify), the tiny
# task's queries (chatterbot-corpus), and transformers itself (the image's 5.17 predates the `cache`
# argument of 5.24) with the huggingface-hub it checks for when imported (>=1.31; 5.17 asked only >=1.5,
# so the image's may be older; 1.33 is the last 1.x, which needs no package the image's 1.x lacks; CI has 2.4);
# the others' versions as this project's CI installs them
download "$wheels" transformers==5.24.0 huggingface-hub==1.33.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
    math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 chatterbot-corpus==1.3.3
download "$wheels/trl112" trl==1.12.0
download "$wheels/trl116" trl==1.16.0
du -sh "$wheels"
