"""The RoPE forms ops/triton_indexer_q.py writes out are the ones ptxas builds
for vLLM's own indexer-query kernel on sm_90 with the installed Triton
(scripts/rope_fma_forms.py reads them from its SASS, no GPU needed): where
Triton fuses by default (``ROPE_FUSED``), in both of a pair's values the
first value's product, ``fma(x0, cos, -(x1 * sin))`` and ``fma(x0, sin, x1 *
cos)``; where it does not, none.  A Triton whose build of vLLM's kernel fuses
otherwise fails here, before any GPU run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_dsa_varlen.ops.triton_fused_q import ROPE_FUSED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_vllms_kernel_fuses_the_first_values_products():
    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "rope_fma_forms.py")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got, case = {}, None
    for line in proc.stdout.splitlines():
        if line.endswith("table:"):
            case = line[:-len(" cos|sin table:")]
            got[case] = []
        elif line.startswith("  "):
            got[case].append(line.strip())
    fused = ROPE_FUSED  # read in this process, under the same environment
    want = {}
    for layout, x1 in (("NeoX", "0x40"), ("interleaved", "0x2")):
        for table, sin in (("fp32", "0x80"), ("bf16", "0x40")):
            # cs[+0x0] is cos, cs[+sin] sin; q[+0x0] is x0, q[+x1] x1
            want[f"{layout}, {table}"] = [
                f"fma(cs[+0x0], q[+0x0], -(cs[+{sin}] * q[+{x1}]))",
                f"fma(cs[+{sin}], q[+0x0], (cs[+0x0] * q[+{x1}]))"] if fused else []
    assert got == want, proc.stdout
