#!/usr/bin/env bash
# Install vllm==0.33.0 (with its pinned torch), this checkout (editable) and the
# test tools into a separate virtualenv, so the global python keeps vLLM 0.27.1
# (scripts/setup.sh).  The venv is $VLLM_DSA_VENV_0_33, default
# .venv-vllm-0.33 inside this checkout (git-ignored).  Works on a fresh machine
# with a package index; re-running is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VLLM_DSA_VENV_0_33:-$ROOT/.venv-vllm-0.33}
BASE_PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$BASE_PY" -m venv "$VENV"
fi
PY=$VENV/bin/python
"$PY" -m pip install -q -e "$ROOT[vllm-0-33,test]"
# PyPI's torchvision / torchaudio / torchcodec wheels may not load beside the
# torch that vLLM pins ("operator torchvision::nms does not exist", missing
# FFmpeg libraries); vLLM imports fine without them: remove any that cannot be
# imported so nothing half-imports them.
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1 && ! "$PY" -c "import $pkg" >/dev/null 2>&1; then
    echo "removing $pkg: it does not import beside this torch"
    "$PY" -m pip uninstall -q -y "$pkg"
  fi
done
"$PY" - <<'PY'
import importlib.metadata as md
import vllm_dsa_varlen
import vllm.v1.attention.backends.mla.indexer  # noqa: F401  (the module the 0.33 patches target)
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.value.startswith("vllm_dsa_varlen")]
assert eps, "vllm.general_plugins entry point not registered"
assert md.version("vllm").startswith("0.33."), md.version("vllm")
print("vllm", md.version("vllm"), "| torch", md.version("torch"), "| plugin entry point:", eps[0].value)
PY
echo "venv: $VENV  (tests: $VENV/bin/python -m pytest -q tests)"
