"""Whether an edit of the CUDA sources changed a shipped kernel: every build
the package ships (the logits kernel's, the planner's, the decode top-k's),
compiled from the sources at a git revision and from the working tree.

    python3 scripts/compare_kernel_builds.py [--base REV] [--no-nvrtc] [--show]

Per build it compares the preprocessed sources (``cpp -P`` with the build's
``-D`` macros, comments gone) token by token, after folding integer constant
expressions (:func:`fold`: a ``(3 == 4 ? 104 : 160)`` reads ``160``) and
dropping empty statements (what a macro expanding to nothing leaves), and,
where NVRTC loads, the cubins NVRTC makes (the code that runs), byte by byte.
Exit status 1 when a cubin differs, or, without NVRTC, when tokens do.
Token differences left after folding are listed with ``--show``: an edit that
deletes code no build uses leaves some while its cubins stay the same.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's package, whatever is installed
CUDA = "vllm_dsa_varlen/ops/cuda"

_TOKEN = re.compile(r"""
    "(?:\\.|[^"\\])*"            # string literal
  | '(?:\\.|[^'\\])*'            # character literal
  | \d[\w.]*                     # number
  | [A-Za-z_]\w*                 # identifier
  | <<=|>>=|->|\+\+|--|<<|>>|<=|>=|==|!=|&&|\|\||::|[-+*/%&|^!=<>]=
  | \S                           # any other punctuator
""", re.VERBOSE)
_INT = re.compile(r"(?:0[xX][0-9a-fA-F]+|\d+)[uUlL]*$")
_OPERATORS = {"(", ")", "+", "-", "*", "/", "%", "<<", ">>", "<", ">", "<=", ">=", "==", "!=",
              "&", "^", "|", "&&", "||", "!", "~", "?", ":"}


def tokens(text: str) -> list[str]:
    """C tokens of preprocessed source."""
    return _TOKEN.findall(text)


def _constant(group: list[str]) -> bool:
    """Whether tokens are an integer constant expression (literals and operators only)."""
    return any(t not in ("(", ")") for t in group) and all(
        _INT.match(t) or t in _OPERATORS for t in group)


_LEVELS = (("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", ">", "<=", ">="),
           ("<<", ">>"), ("+", "-"), ("*", "/", "%"))
_BINARY = {"||": lambda a, b: int(bool(a) or bool(b)), "&&": lambda a, b: int(bool(a) and bool(b)),
           "|": lambda a, b: a | b, "^": lambda a, b: a ^ b, "&": lambda a, b: a & b,
           "==": lambda a, b: int(a == b), "!=": lambda a, b: int(a != b),
           "<": lambda a, b: int(a < b), ">": lambda a, b: int(a > b),
           "<=": lambda a, b: int(a <= b), ">=": lambda a, b: int(a >= b),
           "<<": lambda a, b: a << b, ">>": lambda a, b: a >> b,
           "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
           "/": lambda a, b: abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1),
           "%": lambda a, b: a - _BINARY["/"](a, b) * b}
_UNARY = {"!": lambda a: int(not a), "~": lambda a: ~a, "-": lambda a: -a, "+": lambda a: a}


def _value(group: list[str]) -> int:
    """The value of an integer constant expression, by C's grammar and
    operators (``ValueError`` when it does not parse)."""
    pos = 0

    def peek():
        return group[pos] if pos < len(group) else None

    def take(want=None):
        nonlocal pos
        if pos >= len(group) or (want is not None and group[pos] != want):
            raise ValueError(f"expected {want or 'a token'} at {pos} in {' '.join(group)!r}")
        pos += 1
        return group[pos - 1]

    def conditional():
        c = binary(0)
        if peek() == "?":
            take()
            yes = conditional()
            take(":")
            no = conditional()
            return yes if c else no
        return c

    def binary(level):
        if level == len(_LEVELS):
            return unary()
        left = binary(level + 1)
        while peek() in _LEVELS[level]:
            op = take()
            left = _BINARY[op](left, binary(level + 1))
        return left

    def unary():
        t = take()
        if t in _UNARY:
            return _UNARY[t](unary())
        if t == "(":
            got = conditional()
            take(")")
            return got
        if _INT.match(t):
            digits = re.sub(r"[uUlL]+$", "", t)
            base = 16 if digits[:2] in ("0x", "0X") else 8 if digits[:1] == "0" else 10
            return int(digits, base)
        raise ValueError(f"not a constant: {t!r}")

    got = conditional()
    if pos != len(group):
        raise ValueError(f"trailing tokens in {' '.join(group)!r}")
    return got


_KEYWORDS = {"return", "case", "else", "do"}  # a parenthesis after these is not a call's


def _true_and(toks: list[str]) -> list[str] | None:
    """``toks`` without the first ``= c &&`` initializer's ``c &&`` (``c`` a
    nonzero literal; the rest up to its ``;`` or ``,`` holds no top-level
    ``||``), or ``None`` where there is none."""
    for i in range(len(toks) - 2):
        if toks[i] == "=" and _INT.match(toks[i + 1]) and toks[i + 2] == "&&" \
                and _value([toks[i + 1]]):
            depth, j = 0, i + 3
            while j < len(toks) and not (depth == 0 and toks[j] in (";", ",")):
                depth += toks[j] in "([{"
                depth -= toks[j] in ")]}"
                if depth == 0 and toks[j] == "||":
                    break
                j += 1
            else:
                return toks[:i + 1] + toks[i + 3:]
    return None


def _split_top(group: list[str], op: str) -> int:
    """Index of the first ``op`` at the top level of ``group``, or -1."""
    depth = 0
    for i, t in enumerate(group):
        depth += t == "("
        depth -= t == ")"
        if t == op and depth == 0:
            return i
    return -1


def fold(toks: list[str]) -> list[str]:
    """``toks`` with integer constant expressions folded, until nothing changes:
    a parenthesised constant (not a call's arguments) becomes its value, a
    parenthesised ``c ? a : b``, ``c || x`` or ``c && x`` whose ``c`` is
    constant is decided, and an initializer's leading ``1 &&`` goes."""
    changed = True
    while changed:
        changed = False
        dropped = _true_and(toks)
        if dropped is not None:
            toks, changed = dropped, True
            continue
        stack: list[int] = []
        for i, t in enumerate(toks):
            if t == "(":
                stack.append(i)
            elif t == ")" and stack:
                start = stack.pop()
                inner = toks[start + 1:i]
                before = toks[start - 1] if start else ""
                call = (bool(re.match(r"[A-Za-z_\"']", before)) and before not in _KEYWORDS
                        or before in (")", "]"))
                got = _decide(inner)
                if got is not None and not (call and len(got) == 1):
                    toks = toks[:start] + got + toks[i + 1:]
                    changed = True
                    break
    return toks


def _decide(inner: list[str]) -> list[str] | None:
    """What a parenthesised group folds to, or ``None``."""
    if _constant(inner):
        try:
            return [str(_value(inner))]
        except (ValueError, ZeroDivisionError):
            return None
    if _split_top(inner, ",") >= 0:
        return None
    q = _split_top(inner, "?")
    if q > 0 and _constant(inner[:q]) and _split_top(inner[q + 1:], "?") < 0:
        c = _split_top(inner[q + 1:], ":")
        if c >= 0:
            yes, no = inner[q + 1:q + 1 + c], inner[q + 2 + c:]
            return ["("] + (yes if _value(inner[:q]) else no) + [")"]
    for op in ("||", "&&"):
        at = _split_top(inner, op)
        if at > 0 and _constant(inner[:at]) and (op == "||" or _split_top(inner, "||") < 0):
            first = bool(_value(inner[:at]))
            if first == (op == "||"):
                return ["1" if op == "||" else "0"]
            return ["("] + inner[at + 1:] + [")"]
    return None


def _no_empty_statements(toks: list[str]) -> list[str]:
    """``toks`` without empty statements: a ``;`` right after ``;``, ``{`` or
    ``}`` outside parentheses (what a macro that expands to nothing leaves)."""
    out: list[str] = []
    depth = 0  # inside parentheses (a for loop's header) a ';' is no statement
    for t in toks:
        depth += (t == "(") - (t == ")")
        if t == ";" and depth == 0 and out and out[-1] in (";", "{", "}"):
            continue
        out.append(t)
    return out


def preprocess(path: str, defines: tuple) -> list[str]:
    """The tokens of ``path`` through ``cpp`` with ``defines``, folded."""
    out = subprocess.run(["cpp", "-P", "-undef", "-x", "c++", "-std=c++17",
                          *(f"-D{d}" for d in defines), path],
                         capture_output=True, text=True, check=True).stdout
    return fold(_no_empty_statements(tokens(out)))


def shipped() -> list[tuple[str, tuple]]:
    """``(source file, defines)`` of every build the working tree ships."""
    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
    from vllm_dsa_varlen.ops import cuda_plan as cp
    from vllm_dsa_varlen.ops import cuda_topk as ct

    return ([("sm90_varlen_logits.cu", b) for b in ck.shipped_builds()]
            + [("sm90_plan.cu", cp.defines_for(h)) for h in cp.HEAD_COUNTS]
            + [("decode_topk.cu", b) for b in ct.plan_builds()])


def base_sources(rev: str, into: str) -> None:
    """The CUDA sources at ``rev`` written into the folder ``into``."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{CUDA}"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        text = subprocess.run(["git", "show", f"{rev}:{CUDA}/{name}"], cwd=ROOT,
                              capture_output=True, check=True).stdout
        with open(os.path.join(into, name), "wb") as f:
            f.write(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision to compare against "
                        "(default HEAD)")
    parser.add_argument("--no-nvrtc", action="store_true", help="compare tokens only")
    parser.add_argument("--show", action="store_true", help="print the token differences")
    args = parser.parse_args(argv)
    compile_source = None
    if not args.no_nvrtc:
        from vllm_dsa_varlen.ops import cuda_binding as cb
        try:
            cb.nvrtc()
            compile_source = cb.compile_source
        except OSError as exc:
            print(f"no NVRTC ({exc}): tokens only")
    failed = 0
    with tempfile.TemporaryDirectory() as base:
        base_sources(args.base, base)
        for name, defines in shipped():
            old_path, new_path = os.path.join(base, name), os.path.join(ROOT, CUDA, name)
            old, new = preprocess(old_path, defines), preprocess(new_path, defines)
            hunks = [op for op in difflib.SequenceMatcher(None, old, new, autojunk=False)
                     .get_opcodes() if op[0] != "equal"]
            row = f"{name:24} {'+'.join(defines) or 'default':56} tokens " + (
                "identical" if not hunks else f"{len(hunks)} differences")
            same = not hunks
            if compile_source is not None:
                flags = tuple(f"-D{d}" for d in defines)
                same = compile_source(old_path, extra=flags)[0] == \
                    compile_source(new_path, extra=flags)[0]
                row += f", cubin {'identical' if same else 'DIFFERS'}"
            failed += not same
            print(row, flush=True)
            if args.show:
                for tag, i1, i2, j1, j2 in hunks:
                    print(f"    {tag}: {' '.join(old[i1:i2])!r} -> {' '.join(new[j1:j2])!r}")
    print(f"{failed} build(s) differ" if failed else "every shipped build is unchanged")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
