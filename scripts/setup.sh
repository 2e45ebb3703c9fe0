#!/usr/bin/env bash
# Install the project beside vllm==0.27.1 (with its pinned torch) and the test tools.
# Works on a fresh machine with a package index; re-running is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q -e ".[vllm,test]"
# PyPI's torchvision / torchaudio / torchcodec wheels fail to load beside a CPU
# build of torch ("operator torchvision::nms does not exist"), and vLLM imports
# fine without them: remove them so nothing half-imports them.
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    "$PY" -m pip uninstall -q -y "$pkg"
  fi
done
# pyenv only sees new console scripts (vllm-dsa-varlen-bench) after a rehash.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
"$PY" - <<'PY'
import importlib.metadata as md
import vllm_dsa_varlen
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.value.startswith("vllm_dsa_varlen")]
assert eps, "vllm.general_plugins entry point not registered"
print("vllm", md.version("vllm"), "| torch", md.version("torch"), "| plugin entry point:", eps[0].value)
PY
