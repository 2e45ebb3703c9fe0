#!/usr/bin/env bash
# vLLM 0.34.0 (its pinned torch 2.14), this checkout and the test tools in the
# virtualenv .venv-vllm-0.34 ($DSA_VARLEN_VENV): see setup-vllm-venv.sh.  vLLM's
# own pins do not resolve on the package index (flashinfer-python==0.7.3 is
# missing): it is installed --no-deps beside a pinned list without FlashInfer
# (scripts/vllm-0.34.0-requirements.txt says why).
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/setup-vllm-venv.sh 0.34.0 scripts/vllm-0.34.0-requirements.txt
