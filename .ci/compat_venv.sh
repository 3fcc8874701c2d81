#!/usr/bin/env bash
# Build the compatibility venv: Python 3.10 and the PyTorch of the tutorial's container, with the rest of
# requirements.txt as for the main venv.  Usage: compat_venv.sh VENV "torch==X torchvision==Y"
set -euo pipefail
venv=$1
torch_pins=$2
# the container's Python (3.10) from pyenv where the machine has one; the bare python3.10 shim needs PYENV_VERSION
python=""
if command -v pyenv >/dev/null 2>&1; then
    for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.10\.[0-9]+$' | sort -V -r); do
        python=$(PYENV_VERSION=$version pyenv which python3.10 2>/dev/null) && break
    done
fi
[ -n "$python" ] || python=$(command -v python3.10 2>/dev/null || true)
if [ -z "$python" ] || ! "$python" -c 'import sys' 2>/dev/null; then
    python=python3
    echo "compat venv: no Python 3.10 on this machine; using $($python --version 2>&1) (the container has 3.10)"
fi
rm -rf "$venv"
# about 6.5 GB installed (torch 2.5's CUDA libraries, DALI) and 3 GB of wheels while pip installs them; say so
# in one line before pip runs out of disk halfway.  No pip cache: it would keep another copy of every wheel.
need_gb=10
parent=$(dirname "$venv")
for place in "$parent" "${TMPDIR:-/tmp}"; do
    free_kb=$(df -Pk "$place" | awk 'NR == 2 {print $4}')
    if [ "$free_kb" -lt $((need_gb * 1024 * 1024)) ]; then
        echo "compat venv: $((free_kb / 1024 / 1024)) GB free on $(df -P "$place" | awk 'NR == 2 {print $6}') ($place);" \
            "the torch 2.5 venv needs about $need_gb GB: free some space (old clones, /tmp) and run make test-compat again" >&2
        exit 1
    fi
done
export PIP_NO_CACHE_DIR=1
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# shellcheck disable=SC2086  # the pins are separate words
"$venv/bin/python" -m pip install -q $torch_pins
grep -v -E '^(torch|torchvision)==' requirements.txt > "$venv/requirements-rest.txt"
"$venv/bin/python" -m pip install -q -r "$venv/requirements-rest.txt"
echo "compat venv: $("$venv/bin/python" -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)')"
