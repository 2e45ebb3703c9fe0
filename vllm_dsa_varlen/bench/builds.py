"""``vllm-dsa-varlen-bench --builds``: the sm_90 CUDA kernel's shipped builds
(``-D`` macros of ``ops/cuda/sm90_varlen_logits.cu`` that the settings
select) side by side, each checked against the torch reference on small
steps, then timed in one process, rounds interleaved in a balanced order
(:func:`round_order`; CUDA-graph replay, L2 flushed, the plan made outside
the timed call); with ``--deepgemm`` DeepGEMM's flattened, native and split
paths and its metadata beside them, with ``--topk-lib`` vLLM's decode top-k
and the per-step figures (:func:`per_step`).

    vllm-dsa-varlen-bench --builds default HEAD_SUM_TC=1 NUM_MATH=3+DUAL_ACC=4 \
        [--cases 64,4,32768 64,-4,32768 ...] [--rounds 5] [--deepgemm] \
        [--topk-lib <vllm>/_C_stable_libtorch.abi3.so] [--json f]

A build is ``default`` or ``MACRO=v+MACRO=v``, one of
:func:`.ops.cuda_paged_mqa_logits.shipped_builds` at the run's head count
(:func:`parse_build`).  Cases: ``requests,tokens,context`` (tokens ``-n``:
1..n per request), or ``requests,tokens,context,share``: ``tokens`` per
request but for that share of the requests, cut to fewer (a served step
whose drafts a grammar trimmed; :func:`parse_step_case`).  ``--heads 32`` runs every check and case at 32 heads
(the kernel's HEADS=32 build, which ``launch`` takes from the queries'
shape).
"""

from __future__ import annotations

import json
import statistics

from .graph import FLUSHES, order_cycle, round_order

CASES = ["64,4,32768", "64,2,32768", "64,3,32768", "64,-4,32768", "128,-4,8192", "64,6,8192"]
TOPK_PREFIXES = ("topk-",)  # the top-k paths' names (topk_calls)
LEADS = ("copy", "early")  # --lead: the kernel before each logits path (led_calls)
REP_MS = 30  # do_bench repetition time per timed call (ms) unless --rep-ms says otherwise


def parse_step_case(text: str) -> tuple[int, int, int, float | None]:
    """``"requests,tokens,context[,share]"`` -> ints and the share of short
    requests (``None`` without it); ``ValueError`` naming ``--cases``."""
    from .schedule import parse_case

    head, _, share = text.rpartition(",") if text.count(",") == 3 else (text, "", "")
    reqs, tokens, context = parse_case(head)
    if not share:
        return reqs, tokens, context, None
    try:
        short = float(share)
    except ValueError:
        short = float("nan")
    if not (0.0 < short <= 1.0) or tokens < 2:
        raise ValueError(f"--cases: a share of short requests needs tokens >= 2 and a share in "
                         f"(0, 1], got {text!r}")
    return reqs, tokens, context, short


def _macros(text: str) -> tuple[str, ...]:
    """``"A=1+B=2"`` -> ``("A=1", "B=2")``; ``"default"`` -> ``()``."""
    return () if text in ("", "default") else tuple(text.split("+"))


def shipped_at(heads: int) -> list[tuple[str, ...]]:
    """The logits kernel's shipped builds at ``heads`` heads, as ``--builds``
    names them (without the ``HEADS=32`` that ``launch`` adds)."""
    from ..ops import cuda_paged_mqa_logits as ck

    return [tuple(d for d in b if d != "HEADS=32") for b in ck.shipped_builds()
            if ("HEADS=32" in b) == (heads == 32)]


def parse_build(text: str, heads: int = 64) -> tuple[str, ...]:
    """A ``--builds`` entry -> its macros: ``"default"`` -> ``()``,
    ``"EVICT_FIRST=1+PDL=1"`` -> ``("EVICT_FIRST=1", "PDL=1")``, in any
    order; ``ValueError`` naming ``--builds`` unless it is a shipped build at
    ``heads`` heads (:func:`shipped_at`)."""
    defines = _macros(text)
    shipped = shipped_at(heads)
    if set(defines) not in [set(b) for b in shipped] or len(set(defines)) != len(defines):
        names = ", ".join(sorted(("+".join(b) or "default" for b in shipped),
                                 key=lambda n: (n != "default", n)))
        raise ValueError(f"--builds: {text!r} is not a build this kernel ships at {heads} "
                         f"heads; one of: {names}")
    return defines


def paired_ratios(times: dict, base: str) -> dict:
    """Per path other than ``base``: its time ÷ ``base``'s in the same round
    (rounds interleave every path, so a pair met the same machine state), as
    ``{"median", "min", "max"}``; rounds of 2 or more only."""
    out = {}
    for name, ts in times.items():
        if name == base or len(ts) < 2 or len(ts) != len(times[base]):
            continue
        r = sorted(t / b for t, b in zip(ts, times[base]))
        out[name] = {"median": statistics.median(r), "min": r[0], "max": r[-1]}
    return out


def run(args) -> int:
    """``--builds``: ``args.builds`` (build names), ``cases``, ``rounds``,
    ``rep_ms``, ``heads``, ``deepgemm``, ``topk_lib``, ``layers``, ``json``."""
    import torch
    from triton.testing import do_bench

    from .deepgemm import import_deepgemm
    from .graph import graph_replay_us
    from ..ops import cuda_paged_mqa_logits as ck
    from ..ops.reference import paged_mqa_logits_ref, valid_mask
    from .workloads import PAGE_ORDERS, make_decode_step, random_decode_step

    if not torch.cuda.is_available():
        raise SystemExit("--builds: needs a CUDA GPU (sm_90)")
    args.cases = args.cases or CASES
    # no --rounds: one whole cycle of the balanced order per case (its paths'
    # count decides; 1 in a fixed order)
    args.rep_ms = args.rep_ms or REP_MS
    args.heads = args.heads or 64
    if args.heads not in ck.HEAD_COUNTS:
        raise SystemExit(f"--heads: the CUDA kernel serves {ck.HEAD_COUNTS} heads, got {args.heads}")
    args.variants = args.builds
    flush = args.flush or FLUSHES[0]  # the L2 left clean (graph)
    page_order = args.pages or PAGE_ORDERS[0]  # a permutation of the pool
    dg = None
    if args.deepgemm:
        _, dg = import_deepgemm()
        if dg is None:
            raise SystemExit("--deepgemm: no DeepGEMM importable")
    lead = getattr(args, "lead", None)
    if dg is not None and lead and hasattr(dg, "set_pdl"):
        dg.set_pdl(True)  # as vLLM 0.33 sets it on Hopper (vllm/utils/deep_gemm.py)
    topk_ops = load_topk(torch, args.topk_lib) if args.topk_lib else None
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "deepgemm": getattr(dg, "__version__", None) if dg else None,
              "deepgemm_pdl": bool(dg.get_pdl()) if dg is not None and hasattr(dg, "get_pdl")
              else None,
              "variants": args.variants, "rounds": args.rounds, "layers": args.layers,
              "pages": page_order, "flush": flush, "lead": lead,
              "order": "fixed" if args.fixed_order else "balanced",
              "cases": []}
    variants = {v: parse_build(v, args.heads) for v in args.variants}

    small = [([4, 4, 4, 4], [700, 1500, 64, 2000]), ([3, 1, 2, 4, 3], [10, 3, 130, 999, 64]),
             ([1, 1, 1], [300, 900, 40]), ([7, 5, 6], [5000, 70, 129]), ([4, 3], [2, 3])]
    for name, defines in variants.items():
        worst = 0.0
        for seed, (lens, seqs) in enumerate(small):
            step = make_decode_step(lens, seqs, seed=seed, device="cuda", heads=args.heads)
            rows = step.rows
            ctx = rows.context_lens.view(-1, 1)
            out = torch.full((rows.num_rows, step.max_context_len), float("nan"), device="cuda")
            ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                      step.max_context_len, out, defines=defines)
            ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx, rows.block_table,
                                       step.max_context_len, indices=rows.indices)
            mask = valid_mask(ctx, step.max_context_len, rows.indices)
            ok = torch.isfinite(out[mask]).all() and torch.isnan(out[~mask]).all()
            err = float((out[mask] - ref[mask]).norm() / ref[mask].norm())
            worst = max(worst, err if ok else float("inf"))
        print(f"check {name}: worst relative error {worst:.1e} "
              f"{'OK' if worst < 1e-3 else 'FAIL'}", flush=True)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for case in args.cases:
        reqs, tokens, context, short = parse_step_case(case)
        variable = tokens < 0 or short is not None
        step = random_decode_step(reqs, abs(tokens), context, variable=tokens < 0, short=short,
                                  seed=0, device="cuda", heads=args.heads, pages=page_order)
        rows = step.rows
        ctx = rows.context_lens.view(-1, 1)
        ends = torch.cat([rows.indices[1:] != rows.indices[:-1],
                          torch.ones(1, dtype=torch.bool, device="cuda")])
        pages = int(((rows.context_lens.view(-1)[ends] + 63) // 64).sum())
        out = torch.empty(rows.num_rows, step.max_context_len, device="cuda")
        sched = ck.plan(rows.indices, ctx, step.max_context_len, rows.block_table.shape[1],
                        args.heads)
        calls = {}
        for name, defines in variants.items():
            calls[name] = lambda d=defines: ck.launch(
                step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                step.max_context_len, out, schedule=sched, defines=d)
        first = next(iter(variants))
        extra = {}
        if dg is not None:
            extra.update(deepgemm_calls(torch, step, dg, sms, calls[first], out))
        extra["plan"] = lambda: ck.plan(rows.indices, ctx, step.max_context_len,
                                        rows.block_table.shape[1], args.heads)
        if topk_ops is not None:
            calls[first]()  # the step's logits in `out` before the top-k paths check and copy them
            torch.cuda.synchronize()
            extra.update(topk_calls(torch, topk_ops, step, out, dg, sms,
                                    builds=getattr(args, "topk_builds", None) or ("default",),
                                    width=getattr(args, "topk_width", None),
                                    cooperative_rows=getattr(args, "topk_cooperative_rows",
                                                             None),
                                    eager_line=getattr(args, "topk_eager_line", None)))
        calls.update(extra)
        if lead:
            calls = led_calls(torch, step, calls, lead)
        times = {k: [] for k in calls}
        rounds = case_rounds(args.rounds, len(calls), args.fixed_order)
        if rounds % order_cycle(len(calls)) and not args.fixed_order:
            print(f"  note: {rounds} rounds are not whole cycles of "
                  f"{order_cycle(len(calls))} (the predecessor balance of {len(calls)} paths)",
                  flush=True)
        for r in range(rounds):
            for k in round_order(list(calls), r, args.fixed_order):
                times[k].append(graph_replay_us(torch, do_bench, calls[k], args.rep_ms, flush))
        res = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        spread = max((max(v) - min(v)) / min(v) for v in times.values())
        record = {"case": case, "rows": rows.num_rows, "rounds": rounds, "times_us": times,
                  "median_us": res,
                  "paired_vs_" + first: paired_ratios(times, first)}
        if topk_ops is not None:
            record["per_step_us"] = per_step(res, first, abs(tokens), variable, args.layers)
        report["cases"].append(record)
        label = (f"B{reqs} L{context} {'1..' + str(-tokens) if tokens < 0 else tokens}tok"
                 + ("" if short is None else f" {short:.0%} cut")
                 + ("" if args.heads == 64 else f" H{args.heads}"))
        print(f"{label:22s} " + "  ".join(f"{k} {us:7.1f}" for k, us in res.items())
              + (f"  (median of {rounds}; widest spread {spread:.1%})" if rounds > 1
                 else ""), flush=True)
        if rounds > 1:
            print(f"{'':22s} ÷ {first}, per round, median [min, max]: " + "  ".join(
                f"{k} {r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]"
                for k, r in record["paired_vs_" + first].items()
                if k not in ("plan", "dg-meta")), flush=True)
        print(f"{'':22s} cycles/page at 1.7 GHz: " + "  ".join(
            f"{k} {us * 1e-6 / (pages / sms) * 1.7e9:5.0f}" for k, us in res.items()
            if k in variants), flush=True)
        if "per_step_us" in record:
            print(f"{'':22s} per step ({args.layers} layers, logits + top-k + plan/metadata), "
                  "µs: " + "  ".join(f"{k} {v:8.1f}" for k, v in record["per_step_us"].items()),
                  flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    return 0


def led_calls(torch, step, calls: dict, how: str = "copy") -> dict:
    """``--lead``: each logits path of ``calls`` (not the schedule's, not the
    top-k's) preceded by a kernel that writes the step's queries (their own
    values, so every check still holds), captured with it; and that kernel
    alone as ``lead``, to set against them.  ``how`` (:data:`LEADS`):
    "copy" torch's copy; "early" :func:`early_copy`."""
    if how not in LEADS:
        raise ValueError(f"--lead: expected one of {LEADS}, got {how!r}")
    source = step.q.clone()
    if how == "early":
        copy = early_copy()

        def lead():
            copy(step.q, source)
    else:
        def lead():
            step.q.copy_(source)

    led = {"lead": lead}
    for name, fn in calls.items():
        if name in ("plan", "dg-meta") or name.startswith(TOPK_PREFIXES):
            led[name] = fn
        else:
            led[name] = lambda f=fn: (lead(), f())[1]
    return led


def early_copy():
    """``copy(dst, src)``: a Triton kernel, one program per query head (128
    bytes), launched as a programmatic dependent that waits for the kernel
    before it and at once lets the next one launch (``gdc_wait``, then
    ``gdc_launch_dependents``): the shape of the kernel vLLM 0.33 runs right
    before the indexer's logits (``_fused_q_kernel``: the queries' RoPE and
    fp8 quantisation, a program per token, part and head), so a next kernel
    launched as a programmatic dependent can start while its last programs
    run.  ``RuntimeError`` where this Triton cannot launch so."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _early_copy(dst, src, BYTES: tl.constexpr):
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        offs = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
        tl.store(dst + offs, tl.load(src + offs))

    def copy(dst, src):  # contiguous fp8 queries, rows of 128 bytes
        flat_d, flat_s = dst.view(torch.uint8).reshape(-1), src.view(torch.uint8).reshape(-1)
        width = dst.shape[-1]
        try:
            _early_copy[(flat_d.numel() // width,)](flat_d, flat_s, BYTES=width,
                                                    launch_pdl=True)
        except TypeError as exc:  # a Triton without launch_pdl
            raise RuntimeError(f"--lead early: this Triton cannot launch as a programmatic "
                               f"dependent ({exc})") from exc
    return copy


def case_rounds(asked: int | None, paths: int, fixed_order: bool = False) -> int:
    """Timed rounds of a case: ``asked`` (``--rounds``), else one whole cycle of
    the balanced order for its ``paths`` (:func:`.graph.order_cycle`;
    1 in a fixed order)."""
    if asked is not None:
        if asked < 1:
            raise ValueError(f"--rounds: expected >= 1, got {asked}")
        return asked
    return 1 if fixed_order else order_cycle(paths)


def deepgemm_calls(torch, step, dg, sms, ours, out):
    """DeepGEMM's paths on ``step`` as stock vLLM 0.33 runs them
    (:func:`.deepgemm.vdg_paths`: flattened, native next_n 1/2/4,
    split), checked against this project's logits first, and its schedule
    metadata (``dg-meta``, as the builder makes it once per step)."""
    from .deepgemm import vdg_paths
    from ..ops.reference import valid_mask

    rows = step.rows
    ctx2d = rows.context_lens.view(-1, 1).contiguous()
    mask = valid_mask(ctx2d, step.max_context_len, rows.indices)
    ours()
    mine = out.clone()
    calls = {}
    for name, path in vdg_paths(torch, step, dg, sms).items():
        got = path.fn().float()
        if path.result is not None:
            got = path.result()
        if path.row_of is not None:
            got = got[path.row_of]
        got = got[:, : step.max_context_len]
        err = float((got[mask] - mine[mask]).norm() / mine[mask].norm().clamp_min(1e-30))
        print(f"  {name} vs ours: relative difference {err:.1e}", flush=True)
        calls[name.replace("vdg281", "dg")] = path.fn
    calls["dg-meta"] = lambda: dg.get_paged_mqa_logits_metadata(ctx2d, 64, sms)
    return calls


def load_topk(torch, lib):
    """vLLM's decode top-k ops from its ``_C`` extension at ``lib``."""
    torch.ops.load_library(lib)
    return torch.ops._C


def topk_build(text: str, flag: str = "--topk-builds") -> tuple[tuple, int | str | None]:
    """A ``--topk-builds`` entry -> (the kernel's ``-D`` macros, a host bound
    on the lengths or ``None``): ``"default"`` is the launch plan's build,
    ``"THREADS=512+LIST=0+MINB=4+SPLIT=1+bound=8192"`` a planned build and
    ``bound`` (which sizes the plan and the stage, as vLLM's ``max_seq_len``
    does in serving); ``bound=step``: the step's longest row (``"step"``).
    ``ValueError`` naming ``flag`` for a build :func:`.ops.cuda_topk.plan_builds`
    does not list."""
    from ..ops import cuda_topk as ct

    given = _macros(text)
    bound = [d.split("=", 1)[1] for d in given if d.startswith("bound=")]
    if len(bound) > 1:
        raise ValueError(f"{flag} {text!r}: one bound=N at most")
    defines = tuple(d for d in given if not d.startswith("bound="))
    if defines and not ct.is_planned(defines):
        names = ", ".join("+".join(b) for b in ct.plan_builds())
        raise ValueError(f"{flag} {text!r}: not a build the top-k plans; one of: "
                         f"{names} (or default)")
    if bound and bound[0] != "step" and not (bound[0].isdigit() and int(bound[0]) >= 1):
        raise ValueError(f"{flag} {text!r}: bound=N takes an int >= 1 or 'step'")
    return defines, (bound[0] if bound[0] == "step" else int(bound[0])) if bound else None


def vllm_topk_op(rows: int, row_stride: int, cooperative_rows: int) -> str:
    """The decode top-k op vLLM's call takes on sm_90 for ``k`` of 512, 1024
    or 2048: ``cooperative_topk`` up to ``cooperative_rows`` rows whose row
    stride is a multiple of 4 (its TMA's 16 bytes), else ``persistent_topk``
    (0.27.1's indexer: 32 rows; 0.33.0's ``auto`` chain: 64)."""
    return ("cooperative_topk" if rows <= cooperative_rows and row_stride % 4 == 0
            else "persistent_topk")


# The ``max_seq_len`` vLLM's decode top-k call passes in an eager step, per line
# and op: "step" (the step's longest row) or "width" (the logits' width).  Under
# CUDA-graph capture both lines pass max_model_len, the width of the engine's
# logits.  And up to how many rows each line's call takes cooperative_topk.
EAGER_MAX_SEQ_LEN = {"0.27.1": {"cooperative_topk": "step", "persistent_topk": "width"},
                     "0.33.0": {"cooperative_topk": "step", "persistent_topk": "step"}}
LINE_COOPERATIVE_ROWS = {"0.27.1": 32, "0.33.0": 64}


def vllm_max_seq_len(op: str, eager_line: str | None, step_max: int, width: int) -> int:
    """What vLLM's ``op`` gets as ``max_seq_len``: the logits' width for a
    captured step's call (``eager_line`` None), else as ``eager_line``'s eager
    call passes it (:data:`EAGER_MAX_SEQ_LEN`)."""
    if eager_line is None:
        return width
    if eager_line not in EAGER_MAX_SEQ_LEN:
        raise ValueError(f"eager_line: expected one of {sorted(EAGER_MAX_SEQ_LEN)}, "
                         f"got {eager_line!r}")
    return step_max if EAGER_MAX_SEQ_LEN[eager_line][op] == "step" else width


def topk_calls(torch, ops, step, out, dg, sms, k=2048, builds=("default",), width=None,
               cooperative_rows=None, eager_line=None):
    """vLLM's decode top-k (:func:`vllm_topk_op`: ``cooperative_topk`` up to
    ``cooperative_rows`` rows on sm_90, else ``persistent_topk``; by default
    32, as vLLM 0.27.1's indexer picks) on the step's varlen
    rows (``topk-rows``: what the plugin and stock's flattened call feed it) and
    on its padded native rows (``topk-padded``, next_n 4 or the uniform length
    1/2/4: the same logits where the step is uniform in that length, else
    random normal ones); each checked against ``torch.topk`` on a few rows
    first (``out`` must hold the step's logits when called); beside
    each, this project's top-k in each of ``builds`` (``default``: the launch
    plan's build for the shape, ``<layout>-ours``; ``MACRO=v+...`` of
    ``cuda/decode_topk.cu``, e.g. ``SPLIT=2+MINB=1``: ``<layout>-ours[<build>]``;
    :func:`topk_build`).  ``width``: logits of that many columns, the step's
    in the first (the rest -inf), vLLM's op given it as ``max_seq_len`` and
    this project's no bound (a captured step's call); ``None``: the step's.
    ``eager_line`` ("0.27.1", "0.33.0"): vLLM's op gets ``max_seq_len`` as that
    line's eager call passes it, and takes cooperative_topk up to that line's rows
    unless ``cooperative_rows`` says otherwise (:func:`vllm_max_seq_len`)."""
    from ..topk import COOPERATIVE_ROWS

    if cooperative_rows is None:
        cooperative_rows = LINE_COOPERATIVE_ROWS.get(eager_line, COOPERATIVE_ROWS)
    rows = step.rows
    ctx2d = rows.context_lens.view(-1, 1).contiguous()
    if width is None:
        width = out.shape[1]
    elif width < out.shape[1]:
        raise ValueError(f"--topk-width: expected >= the step's {out.shape[1]} columns, "
                         f"got {width}")
    else:
        wide = torch.full((out.shape[0], width), float("-inf"), device=out.device)
        wide[:, :out.shape[1]] = out
        out = wide
    calls = {}
    layouts = [("topk-rows", out, ctx2d)]
    longest, shortest = int(step.decode_lens.max()), int(step.decode_lens.min())
    next_n = longest if longest == shortest and longest in (1, 2, 4) else 4 if longest <= 4 else 0
    if next_n:
        pad = step.padded(next_n)
        if next_n == longest == shortest and pad["context_lens"].numel() == out.shape[0]:
            # uniform: the padded rows are the step's rows
            logits = out
        else:
            logits = torch.randn((pad["context_lens"].numel(), width), device=out.device)
        layouts.append(("topk-padded", logits, pad["context_lens"].reshape(-1, next_n)))
    for name, logits, lens in layouts:
        n = logits.shape[0]
        idx = torch.full((n, k), -1, dtype=torch.int32, device=out.device)
        work = torch.empty(1 << 20, dtype=torch.uint8, device=out.device)
        which = vllm_topk_op(n, logits.stride(0), cooperative_rows)
        op = getattr(ops, which)
        bound = vllm_max_seq_len(which, eager_line, int(lens.max()), logits.shape[1])
        fn = (lambda op=op, lg=logits, ln=lens, i=idx, w=work, b=bound:
              op(lg, ln, i, w, k, b))
        fn()
        flat = lens.reshape(-1)
        agree = []
        for r in range(0, n, max(1, n // 8)):
            length = int(flat[r])
            want = set(torch.topk(logits[r, :length], min(k, length)).indices.tolist())
            got = {i for i in idx[r].tolist() if i >= 0}
            agree.append(len(want & got) / max(1, len(want)))
        print(f"  {name} ({which}, {n} rows, max_seq_len {bound}): "
              f"sets agree with torch.topk {min(agree):.4f} (worst of {len(agree)} rows)",
              flush=True)
        calls[name] = fn
        for build in builds:
            defines, bound = topk_build(build)
            if bound == "step":
                bound = int(flat.max())
            label = name + "-ours" + (f"[{build}]" if defines or bound else "")
            calls[label] = own_topk_call(torch, label, logits, lens, k, defines or None, bound)
    return calls


def own_topk_call(torch, name, logits, lens, k, defines=None, bound=None):
    """This project's decode top-k (:func:`.ops.cuda_topk.decode_topk`; build
    ``defines``, ``None`` for the launch plan's; ``bound`` on the lengths) on
    the same rows, checked against the reference's contract on every eighth
    row first (``SystemExit`` where it fails)."""
    from ..ops.cuda_topk import decode_topk
    from ..ops.reference import topk_selection_ok

    out = torch.full((logits.shape[0], k), -7, dtype=torch.int32, device=logits.device)
    fn = lambda: decode_topk(logits, lens, k, out=out, defines=defines,  # noqa: E731
                             bound=bound)
    fn()
    some = torch.arange(0, logits.shape[0], 8, device=logits.device)
    errors = topk_selection_ok(logits[some].cpu(), lens.reshape(-1)[some].cpu(), k,
                               out[some].cpu())
    print(f"  {name} (decode_topk): {len(errors)} of {some.numel()} rows off the "
          f"contract{': ' + errors[0] if errors else ''}", flush=True)
    if errors:
        raise SystemExit(f"decode_topk failed its check on {name}")
    return fn


def per_step(res: dict, ours: str, tokens: int, variable: bool, layers: int) -> dict:
    """A decode step's indexer cost (µs): once per step the schedule (the
    project's plan, DeepGEMM's metadata), per layer the logits and the top-k.
    ``plugin``: this project's kernel (build ``ours``); ``stock 0.33``: its
    native kernel for uniform 1, 2, 4 tokens, its split for variable steps,
    flattened otherwise; ``stock 0.27``: native for 1 and 2 tokens, flattened
    otherwise (DeepGEMM 2.8's kernels standing in for 0.27's 2.6.1)."""
    got = {"plugin": res["plan"] + layers * (res[ours] + res["topk-rows"])}
    if "topk-rows-ours" in res:  # the plugin with this project's top-k too
        got["plugin, own top-k"] = res["plan"] + layers * (res[ours] + res["topk-rows-ours"])
    if "dg-flat" not in res:
        return got
    meta = res["dg-meta"]
    native = next((k for k in res if k.startswith("dg-native")), None)
    flat = meta + layers * (res["dg-flat"] + res["topk-rows"])
    if variable and "dg-split" in res:
        got["stock 0.33"] = meta + layers * (res["dg-split"] + res["topk-rows"])
    elif native and not variable and tokens in (1, 2, 4):  # SM90's native sizes; 3 is flattened
        got["stock 0.33"] = meta + layers * (res[native] + res["topk-padded"])
    else:
        got["stock 0.33"] = flat
    if native and not variable and tokens <= 2:
        got["stock 0.27"] = meta + layers * (res[native] + res["topk-padded"])
    else:
        got["stock 0.27"] = flat
    for k in ("stock 0.33", "stock 0.27"):
        for mine in ("plugin", "plugin, own top-k"):
            if mine in got:
                got[f"{mine} / {k}"] = got[mine] / got[k]
    return got

