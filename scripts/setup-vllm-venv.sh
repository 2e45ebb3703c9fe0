#!/usr/bin/env bash
# Install one vLLM release, this checkout (editable) and the test tools into a
# virtualenv of its own, so the global python keeps vLLM 0.27.1 (scripts/setup.sh):
#   bash scripts/setup-vllm-venv.sh VERSION [REQUIREMENTS]
# Without REQUIREMENTS pip resolves vLLM's own requirements (the project's
# `vllm-X-Y` extra); with it, vLLM is installed --no-deps and its requirements
# come from that pinned list (for a release whose pins do not resolve on the
# package index).  The venv is $DSA_VARLEN_VENV, default .venv-vllm-X.Y inside
# this checkout (git-ignored).  Re-running is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VERSION=${1:?usage: setup-vllm-venv.sh VERSION [REQUIREMENTS]}
REQS=${2:-}
LINE=$(echo "$VERSION" | cut -d. -f1,2)
VENV=${DSA_VARLEN_VENV:-$ROOT/.venv-vllm-$LINE}
BASE_PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$BASE_PY" -m venv "$VENV"
fi
PY=$VENV/bin/python
if [ -n "$REQS" ]; then
  "$PY" -m pip install -q --no-deps "vllm==$VERSION"
  "$PY" -m pip install -q -r "$REQS"
  "$PY" -m pip install -q -e "$ROOT[test]"
else
  "$PY" -m pip install -q -e "$ROOT[vllm-$(echo "$LINE" | tr . -),test]"
fi
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
"$PY" - "$VERSION" <<'PY'
import importlib.metadata as md
import sys

import vllm_dsa_varlen
import vllm.v1.attention.backends.mla.indexer  # noqa: F401  (a module the patches target)
from vllm_dsa_varlen import patches

eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.value.startswith("vllm_dsa_varlen")]
assert eps, "vllm.general_plugins entry point not registered"
assert md.version("vllm") == sys.argv[1], md.version("vllm")
assert not patches.upstream_differences(patches.installed_line()), "the installed vLLM differs"
print("vllm", md.version("vllm"), "| torch", md.version("torch"), "| plugin entry point:", eps[0].value)
PY
echo "venv: $VENV  (tests: $VENV/bin/python -m pytest -q tests)"
