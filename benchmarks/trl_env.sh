#!/usr/bin/env bash
# TRL in an environment of its own (never a project dependency), for the speed comparisons:
#
#     bash benchmarks/trl_env.sh .venv-trl 1.12.0       # prints the environment's python
#
# The environment sees the packages of the Python that runs this (`python3`, or $PYTHON) through a .pth file
# that adds its site folder, which works from a virtual environment too (`venv --system-site-packages` would
# see the system's, not the virtual environment's). Made again only when TRL's version there is not VERSION.
set -euo pipefail
folder=$1 version=$2
python=${PYTHON:-python3}
if ! "$folder/bin/python" -c "import trl, sys; sys.exit(trl.__version__ != '$version')" 2>/dev/null; then
    rm -rf "$folder"
    "$python" -m venv "$folder"
    parent=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    site=$("$folder/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "import site; site.addsitedir('$parent')" >"$site/lmhpd-parent.pth"
    "$folder/bin/python" -m pip install -q --disable-pip-version-check --no-deps "trl==$version" >&2
fi
echo "$(cd "$folder" && pwd)/bin/python"
