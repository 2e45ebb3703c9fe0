"""benchmarks/cuda_sm90_variants.py: its variant syntax (CPU)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "cuda_sm90_variants", os.path.join(ROOT, "benchmarks", "cuda_sm90_variants.py"))
variants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(variants)


def test_variant_syntax():
    assert variants.parse_variant("default") == ((), None)
    assert variants.parse_variant("default@1,0") == ((), (1, 0))
    assert variants.parse_variant("MATH_REGS=112+PRODUCER_REGS=24@5,2") == (
        ("MATH_REGS=112", "PRODUCER_REGS=24"), (5, 2))
