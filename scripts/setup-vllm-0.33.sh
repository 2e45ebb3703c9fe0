#!/usr/bin/env bash
# vLLM 0.33.0 (its pinned torch 2.14), this checkout and the test tools in the
# virtualenv .venv-vllm-0.33 ($DSA_VARLEN_VENV): see setup-vllm-venv.sh.
set -euo pipefail
exec bash "$(dirname "$0")/setup-vllm-venv.sh" 0.33.0
