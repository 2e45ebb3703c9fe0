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


def _times(**kw):
    import random

    base = {k: random.uniform(1, 200) for k in ("default", "plan", "dg-meta", "dg-flat",
                                                "topk-rows", "topk-padded")}
    base.update(kw)
    return base


def test_per_step_sums_the_paths_each_line_takes():
    """Per-step figures: once per step the plan / metadata, per layer logits +
    top-k; stock 0.33 takes native for uniform 1/2/4, its split for variable
    steps, flattened otherwise; stock 0.27 native only up to 2 tokens."""
    layers = 61
    for tokens, variable, native in ((4, False, "dg-native4"), (2, False, "dg-native2"),
                                     (3, False, None), (4, True, "dg-native4")):
        res = _times(**({native: 77.0} if native else {}), **({"dg-split": 300.0} if variable
                                                              else {}))
        got = variants.per_step(res, "default", tokens, variable, layers)
        assert got["plugin"] == res["plan"] + layers * (res["default"] + res["topk-rows"])
        flat = res["dg-meta"] + layers * (res["dg-flat"] + res["topk-rows"])
        if variable:
            want33 = res["dg-meta"] + layers * (res["dg-split"] + res["topk-rows"])
        elif native:
            want33 = res["dg-meta"] + layers * (res[native] + res["topk-padded"])
        else:
            want33 = flat
        assert got["stock 0.33"] == want33
        want27 = (res["dg-meta"] + layers * (res[native] + res["topk-padded"])
                  if native and not variable and tokens <= 2 else flat)
        assert got["stock 0.27"] == want27
        assert got["plugin / stock 0.33"] == got["plugin"] / want33
    # without DeepGEMM only the plugin's figure
    res = {"default": 10.0, "plan": 5.0, "topk-rows": 3.0}
    assert variants.per_step(res, "default", 4, False, 2) == {"plugin": 5.0 + 2 * 13.0}
