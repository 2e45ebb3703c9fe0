"""scripts/compare_kernel_builds.py, the check that an edit of the CUDA
sources left every shipped build's code alone: its C constant evaluator
against an independent one on random expressions, its folding, and its
comparison of two sources (``cpp``; NVRTC where it loads)."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "compare_kernel_builds", os.path.join(ROOT, "scripts", "compare_kernel_builds.py"))
ckb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ckb)

CPP = shutil.which("cpp")


def _c_div(a, b):
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def _tree(rng, depth):
    """A random integer expression: (text, value), C's semantics computed on
    the tree (fully parenthesised, so the evaluator's precedence is not what
    decides it here; the unparenthesised test below checks precedence)."""
    if depth == 0 or rng.random() < 0.3:
        v = rng.randint(0, 9)
        return str(v), v
    kind = rng.choice(["bin", "bin", "bin", "un", "tern"])
    if kind == "un":
        op = rng.choice(["!", "-", "~"])
        t, v = _tree(rng, depth - 1)
        return f"{op}({t})", {"!": int(not v), "-": -v, "~": ~v}[op]
    if kind == "tern":
        (c, cv), (a, av), (b, bv) = (_tree(rng, depth - 1) for _ in range(3))
        return f"(({c}) ? ({a}) : ({b}))", av if cv else bv
    op = rng.choice(["+", "-", "*", "/", "%", "==", "!=", "<", ">=", "&&", "||", "&", "|", "^",
                     "<<"])
    (a, av), (b, bv) = _tree(rng, depth - 1), _tree(rng, depth - 1)
    if op in ("/", "%") and bv == 0:
        op = "+"
    if op == "<<" and (av < 0 or not 0 <= bv < 8):  # C leaves these undefined
        op = "^"
    value = {"+": lambda: av + bv, "-": lambda: av - bv, "*": lambda: av * bv,
             "/": lambda: _c_div(av, bv), "%": lambda: av - _c_div(av, bv) * bv,
             "==": lambda: int(av == bv), "!=": lambda: int(av != bv),
             "<": lambda: int(av < bv), ">=": lambda: int(av >= bv),
             "&&": lambda: int(bool(av) and bool(bv)), "||": lambda: int(bool(av) or bool(bv)),
             "&": lambda: av & bv, "|": lambda: av | bv, "^": lambda: av ^ bv,
             "<<": lambda: av << bv}[op]()
    return f"({a}) {op} ({b})", value


@pytest.mark.parametrize("seed", range(200))
def test_the_evaluator_computes_cs_value(seed):
    rng = random.Random(seed)
    text, want = _tree(rng, rng.randint(1, 5))
    assert ckb._value(ckb.tokens(text)) == want, text


@pytest.mark.parametrize("text, want", [
    ("1 + 2 * 3", 7), ("10 - 4 - 3", 3), ("1 << 2 + 1", 8), ("2 < 3 == 1", 1),
    ("1 | 2 ^ 3 & 4", 3), ("0 && 1 || 1", 1), ("1 ? 2 : 0 ? 3 : 4", 2),
    ("0 ? 2 : 0 ? 3 : 4", 4), ("!0 + 1", 2), ("4 == 4 && 3 == 3 && !0", 1),
    ("3 == 4 ? 104 : 0 ? 160 : 152", 152), ("-7 / 2", -3), ("-7 % 2", -1), ("0x10 + 1u", 17), ("010 + 0", 8)])
def test_the_evaluator_keeps_cs_precedence(text, want):
    assert ckb._value(ckb.tokens(text)) == want


def test_folding_decides_constants_and_leaves_calls():
    fold = lambda text: " ".join(ckb.fold(ckb.tokens(text)))  # noqa: E731
    assert fold("x = (4 == 4 ? 104 : 0 ? 160 : 152);") == "x = 104 ;"
    assert fold("if ((4 == 4 && 3 == 3 && !0) && c == 64) f(0);") == "if ( c == 64 ) f ( 0 ) ;"
    assert fold("y = a + (3 == 1 ? 0 : j - 1); z = (3 != 3 || h <= 96);") == (
        "y = a + ( j - 1 ) ; z = ( h <= 96 ) ;")
    assert fold("return (4 == 4) ? a : b;") == "return 1 ? a : b ;"
    assert fold("const bool h = 1 && H && g == 1; k = 0 && x; m = 1 && a || b;") == (
        "const bool h = H && g == 1 ; k = 0 && x ; m = 1 && a || b ;")
    assert fold("g(1); s[(2)]; (u64)(3)") == "g ( 1 ) ; s [ 2 ] ; ( u64 ) ( 3 )"
    assert ckb._no_empty_statements(ckb.tokens("{ ; a; ; } ; for (;;) b;")) == ckb.tokens(
        "{ a; } for (;;) b;")


@pytest.mark.skipif(CPP is None, reason="no cpp here")
def test_sources_that_differ_in_form_compare_equal_and_in_code_do_not(tmp_path):
    old = ("// a comment\n#ifndef STAGES\n#define STAGES 3\n#endif\n#define EMPTY(i)\n"
           "#define REGS (NUM == 4 ? 104 : X ? 160 : 152)\n"
           "int f(int j) { EMPTY(0); return j < STAGES && (STAGES != 3 || j > REGS); }\n")
    new = ("#define STAGES 3  // another comment\n#define REGS (NUM == 4 ? 104 : 160)\n"
           "int f(int j) { return j < STAGES && (j > REGS); }\n")
    changed = new.replace("j > REGS", "j >= REGS")
    paths = {}
    for name, text in (("old", old), ("new", new), ("changed", changed)):
        paths[name] = tmp_path / f"{name}.cu"
        paths[name].write_text(text)
    for defines in (("NUM=4", "X=0"), ("NUM=3", "X=4")):
        want = ckb.preprocess(str(paths["old"]), defines)
        assert ckb.preprocess(str(paths["new"]), defines) == want
        assert ckb.preprocess(str(paths["changed"]), defines) != want


def test_it_checks_every_shipped_build():
    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
    from vllm_dsa_varlen.ops import cuda_plan as cp
    from vllm_dsa_varlen.ops import cuda_topk as ct

    got = ckb.shipped()
    assert [b for f, b in got if f == "sm90_varlen_logits.cu"] == ck.shipped_builds()
    assert [b for f, b in got if f == "sm90_plan.cu"] == [cp.defines_for(h)
                                                          for h in cp.HEAD_COUNTS]
    assert [b for f, b in got if f == "decode_topk.cu"] == ct.plan_builds()
    sources = set(os.listdir(os.path.join(ROOT, ckb.CUDA)))
    assert {f for f, _ in got} == {s for s in sources if s.endswith(".cu")}
