#!/usr/bin/env bash
# Runs the whole test suite on the CPU. The NumPy cross-check needs numpy and safetensors: they
# are used from python3 when present, otherwise installed into a virtualenv under target/.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
source deploy/debian/prereqs.sh

if [ -z "${WORLDLINE_PYTHON:-}" ]; then
  command -v python3 >/dev/null 2>&1 || apt_install python3
  if python3 -c 'import numpy, safetensors' >/dev/null 2>&1; then
    export WORLDLINE_PYTHON=python3
  else
    venv="$root/target/pyenv"
    if [ ! -x "$venv/bin/python" ]; then
      python3 -m venv "$venv" >/dev/null 2>&1 || { apt_install python3-venv; python3 -m venv "$venv"; }
    fi
    "$venv/bin/python" -c 'import numpy, safetensors' >/dev/null 2>&1 ||
      "$venv/bin/pip" install -q numpy safetensors
    export WORLDLINE_PYTHON="$venv/bin/python"
  fi
fi

cargo test --workspace "$@"
