"""Which RoPE products ``ptxas`` fuses in vLLM's indexer-query kernel, read from
its sm_90 SASS without a GPU.

vLLM's ``_fused_indexer_q_rope_quant_kernel`` (``vllm.model_executor.layers.
sparse_attn_indexer``, vLLM 0.27.1 and 0.33.0) writes its RoPE as ``x0 * cos -
x1 * sin`` and ``x1 * cos + x0 * sin`` and leaves the multiply-adds to the
compiler; which product of each it fuses decides the bits of the result, and
the project's kernel (``ops/triton_indexer_q.py``) writes the same forms out.
This script reads the kernel's source from the installed vLLM, compiles it for
sm_90 with the installed Triton (``triton.compile`` with a ``GPUTarget``: no
driver needed), disassembles it with Triton's ``nvdisasm`` and prints, for each
RoPE layout and cos/sin table dtype, every fused multiply-add up to the bf16
roundings with its operands traced back to their loads::

    fma(q[+0x0], cs[+0x0], -(cs[+0x80] * q[+0x40]))

(``q`` / ``cs``: loads from the query row / the cos|sin row, at that byte
offset; NeoX with a float32 table: x0 at +0x0, x1 at +0x40, cos at +0x0,
sin at +0x80.)  Run without ``TRITON_INTERPRET``::

    python3 scripts/rope_fma_forms.py
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_dsa_varlen.ops.compile_check import query_signature  # noqa: E402

KERNEL = "_fused_indexer_q_rope_quant_kernel"


def load_vllm_kernel(tmp: str):
    """vLLM's kernel compiled from its installed source with the real Triton
    (vLLM hands its modules a placeholder ``triton`` where no driver loads)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("vLLM is not installed")
    path = os.path.join(os.path.dirname(spec.origin), "model_executor", "layers",
                        "sparse_attn_indexer.py")
    src = open(path).read()
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == KERNEL)
    out = os.path.join(tmp, "vllm_indexer_q_kernel.py")
    with open(out, "w") as f:
        f.write("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                + ast.get_source_segment(src, node) + "\n")
    mod_spec = importlib.util.spec_from_file_location("vllm_indexer_q_kernel", out)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return getattr(mod, KERNEL)


def sass(fn, table: str, neox: bool, tmp: str) -> str:
    ptr = {"positions": "*i64", "q": "*bf16", "cos_sin_cache": f"*{table}", "q_fp8": "*fp8e4nv",
           "weights": "*bf16", "weights_out": "*fp32"}
    consts = {"fp8_min": -448.0, "fp8_max": 448.0, "is_neox": neox}
    k = triton.compile(ASTSource(fn, query_signature(fn, ptr, consts), consts),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 1, "num_stages": 1})
    cubin = os.path.join(tmp, "k.cubin")
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    return subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout


_INSN = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?P\d\s+)?([A-Z0-9_.]+)\s*([^;]*);", re.M)


def _loads(insns) -> dict[str, tuple[str, str, str]]:
    """Destination register -> (base register, byte offset, width) of each
    16- or 32-bit load before the first bf16 rounding."""
    loads = {}
    for op, args in insns:
        if op.startswith("F2F.BF16"):
            break
        m = re.match(r"(R\d+), desc\[\w+\]\[(R\d+)\.64(?:\+(0x[0-9a-f]+))?\]", args)
        if op.startswith("LDG") and m and ".64" not in op:
            loads[m.group(1)] = (m.group(2), m.group(3) or "0x0", "u16" if ".U16" in op else "b32")
    return loads


def _row_of(loads) -> dict[str, str]:
    """Base register -> ``q`` or ``cs``: the table's loads are 32-bit (float32
    table) or exactly two at +0x0 / +0x40 (bf16 table: cos, sin); the query's
    are the other 16-bit loads."""
    offsets: dict[str, set] = {}
    for base, off, width in loads.values():
        offsets.setdefault(base, set()).add((off, width))
    return {base: "cs" if all(w == "b32" for _, w in offs) or offs == {("0x0", "u16"), ("0x40", "u16")}
            else "q" for base, offs in offsets.items()}


def rope_forms(text: str) -> list[str]:
    """The FFMAs before the first bf16 rounding, operands named by their loads."""
    insns = _INSN.findall(text)
    loads = _loads(insns)
    row = _row_of(loads)
    names = {reg: f"{row[base]}[+{off}]" for reg, (base, off, _) in loads.items()}
    forms = []
    for op, args in insns:
        regs = [a.strip().replace(".reuse", "") for a in args.split(",")]
        if op.startswith("F2F.BF16"):
            break
        if op.startswith("LDG") and regs[0] in loads:
            names[regs[0]] = f"{row[loads[regs[0]][0]]}[+{loads[regs[0]][1]}]"
        elif op in ("IMAD.U32", "SHF.L.U32") and regs[1] in names and regs[2] in ("0x10000", "0x10"):
            names[regs[0]] = names[regs[1]]  # bf16 -> float32: the same value
        elif op == "FMUL" and regs[1] in names and regs[2] in names:
            names[regs[0]] = f"{names[regs[1]]} * {names[regs[2]]}"
        elif op == "FFMA" and regs[1] in names:
            c = regs[3]
            form = (f"fma({names[regs[1]]}, {names.get(regs[2], regs[2])}, "
                    f"{'-' if c.startswith('-') else ''}({names.get(c.lstrip('-'), c)}))")
            forms.append(form)
            names[regs[0]] = form
    return forms


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1")
    print(f"triton {triton.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        fn = load_vllm_kernel(tmp)
        for neox in (True, False):
            for table in ("fp32", "bf16"):
                print(f"{'NeoX' if neox else 'interleaved'}, {table} cos|sin table:")
                for form in rope_forms(sass(fn, table, neox, tmp)):
                    print("  " + form)
    return 0


if __name__ == "__main__":
    sys.exit(main())
