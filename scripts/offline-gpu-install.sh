#!/usr/bin/env bash
# On a GPU host without a package index: receive one transfer folder made by
# scripts/stage-offline-gpu.py (call-N/: parts of one tar.xz + MANIFEST), and once
# every part listed in MANIFEST is there (sha256-checked), unpack the installed
# tree and declare this project's plugin entry point beside it.
#   bash scripts/offline-gpu-install.sh FOLDER|- [TARGET]   (TARGET default /tmp/offline-gpu)
# Prints "complete: export PYTHONPATH=..." when done (this checkout, TARGET/site and the folders
# the tree's .pth files would add), "waiting: ..." otherwise.
# Re-running with a folder already received is harmless.
set -euo pipefail
src=$1
target=${2:-/tmp/offline-gpu}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$target/parts"
if [ "$src" != "-" ]; then  # "-": nothing new, just report (and finish) the install
  cp "$src"/MANIFEST "$target/parts/MANIFEST"
  for f in "$src"/part-*; do cp "$f" "$target/parts/"; done
fi
[ -f "$target/parts/MANIFEST" ] || { echo "waiting: nothing received yet"; exit 0; }
cd "$target/parts"
missing=$(awk '{print $2}' MANIFEST | while read -r p; do [ -f "$p" ] || echo "$p"; done)
if [ -n "$missing" ]; then
  echo "waiting: $(echo "$missing" | wc -l) parts missing ($(echo $missing | tr '\n' ' '))"
  exit 0
fi
if [ ! -f "$target/site/.complete" ]; then
  sha256sum -c --quiet MANIFEST
  rm -rf "$target/site"
  awk '{print $2}' MANIFEST | xargs cat | xz -d -T0 | tar x -C "$target"
  touch "$target/site/.complete"
fi
# The plugin itself is imported from this checkout (PYTHONPATH first), so edits made
# after the install are what runs; only its entry point (vllm.general_plugins) is
# declared here, where importlib.metadata finds it.
info="$target/site/vllm_dsa_varlen-0.0.0.dist-info"
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: vllm-dsa-varlen\nVersion: 0.0.0\n' > "$info/METADATA"
python3 - "$root/pyproject.toml" > "$info/entry_points.txt" <<'PY'
import sys, tomllib
eps = tomllib.load(open(sys.argv[1], "rb"))["project"]["entry-points"]
for group, items in eps.items():
    print(f"[{group}]")
    for name, value in items.items():
        print(f"{name} = {value}")
PY
# A .pth file is read only in a site directory, never through PYTHONPATH: the folders
# that the staged packages' .pth files put on sys.path are named here (NVIDIA's CuTe DSL
# keeps its cutlass package in nvidia_cutlass_dsl/dsl_packages).
path=$root:$target/site
dsl="$target/site/nvidia_cutlass_dsl/dsl_packages"
if [ -d "$dsl" ]; then path=$path:$dsl; fi
echo "complete: export PYTHONPATH=$path"
