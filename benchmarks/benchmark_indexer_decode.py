#!/usr/bin/env python3
"""Decode-indexer benchmark (see ``vllm_dsa_varlen/bench.py``; also installed as
the console script ``vllm-dsa-varlen-bench``).

    python benchmarks/benchmark_indexer_decode.py --json bench.json [--trace trace.json]
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vllm_dsa_varlen.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
