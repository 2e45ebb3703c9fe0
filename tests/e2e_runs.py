"""A run file of ``benchmarks/e2e_decode.py`` (``run-<mode>-k<k>.json``) as
the tests of the harness and of the comparison build it."""


def run_file(tokens: list[list[int]]) -> dict:
    """One case of ``len(tokens)`` requests at 4K (k 3, 100 tokens/s, TPOT 2
    ms, no decode-path counts) that gave ``tokens``."""
    return {"k": 3, "cases": [{"batch": len(tokens), "prompt": 4096, "tokens_per_s": 100.0,
                               "tpot_ms": 2.0, "tokens": tokens,
                               "paths": {k: dict.fromkeys(("varlen",), 0)
                                         for k in ("steps", "variable", "mixed")}}]}
