"""``vllm-dsa-varlen-bench --plan-timing``: the sm_90 CUDA kernel's per-step
schedule timed on the GPU — the one-launch planner (``ops/cuda_plan.py``)
against the torch-operations plan it replaces
(``cuda_paged_mqa_logits.plan_torch``), at 64 and 32 heads (the planner's
two builds: chunks of 4 and 8 rows; ``--heads`` picks one), and, where
importable, DeepGEMM's metadata (``get_paged_mqa_logits_metadata``;
``deep_gemm``, else vLLM's ``vllm_deep_gemm``; it does not depend on the
head count, so it is timed once per case, on the case's first head count),
on the same steps, rounds interleaved.

Each path is captured in a CUDA graph and timed two ways: one replay per
timed call (``do_bench``: L2 flushed before each, CUDA events around it: the
step's latency for the op, with the graph launch) and :data:`COPIES` copies
in one graph replayed back to back (µs per copy: the GPU time a step pays
when the op sits among others).  A one-element ``add_`` timed the same way
gives the floor of both methods.  Every planner output is checked bit for bit
against ``plan_torch`` first; the exit status is 1 when one differs.

    vllm-dsa-varlen-bench --plan-timing [--heads 64|32] [--rounds 5] [--cases 64,4,32768 ...]
                          [--json f]

Cases: ``requests,tokens,context`` (tokens ``-n``: 1..n per request), KV
lengths uniform in context ± 30 %, 7 graph-padding rows.
"""

from __future__ import annotations

import json
import statistics

from .deepgemm import import_deepgemm
from .graph import capture_graph

CASES = ["64,4,32768", "64,4,8192", "128,4,8192", "256,4,8192", "8,4,131072", "16,4,16384",
         "1,4,8192", "64,2,32768", "256,2,4096", "64,3,32768", "64,-4,32768", "128,-4,8192",
         "64,6,8192", "64,8,8192", "1000,8,4096", "1024,8,4096", "2048,4,2048"]
COPIES = 20
REP_MS = 20  # do_bench repetition time per timed round (ms) unless --rep-ms says otherwise
ROUNDS = 5   # timed rounds unless --rounds says otherwise
NAMES = ["plan_torch", "planner", "planner_cut", "dg_meta_flat", "dg_meta_native"]
HEADS = (64, 32)  # head counts timed unless --heads picks one (the planner's builds)


def parse_case(text: str) -> tuple[int, int, int]:
    """``"requests,tokens,context"`` -> ints (``ValueError`` naming ``--cases``)."""
    try:
        reqs, tokens, context = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--cases: expected requests,tokens,context (e.g. 64,-4,8192), "
                         f"got {text!r}") from None
    if reqs < 1 or tokens == 0 or context < 1:
        raise ValueError(f"--cases: expected requests >= 1, tokens != 0, context >= 1, "
                         f"got {text!r}")
    return reqs, tokens, context


def head_counts(heads: int | None) -> tuple[int, ...]:
    """The head counts to time: ``--heads`` (64 or 32; ``ValueError`` naming
    it otherwise) or both."""
    if heads is None:
        return HEADS
    if heads not in HEADS:
        raise ValueError(f"--heads: --plan-timing times the planner's builds, "
                         f"{' or '.join(map(str, HEADS))} heads, got {heads}")
    return (heads,)


def step_rows(torch, reqs: int, tokens: int, context: int, seed: int = 0):
    """A step's rows on the GPU (:func:`..workloads.random_step_rows`, 7
    graph-padding rows) and the request-level context lengths DeepGEMM's
    native path takes."""
    from .workloads import random_step_rows

    n = abs(tokens)
    rows, seqs, lens, width = random_step_rows(reqs, n, context, variable=tokens < 0,
                                               seed=seed)
    native = None
    if tokens > 0:  # [B, next_n] context lengths (DeepGEMM's native layout)
        offs = torch.arange(n, dtype=torch.int32)
        native = (seqs[:, None] - n + 1 + offs[None, :]).clamp_min(0).to(torch.int32).cuda()
    return rows, int(seqs.max()), width, native


def graph_of(torch, fn, copies: int):
    graph = capture_graph(torch, fn, copies)
    torch.cuda.synchronize()
    return graph


def format_table(cases, rounds: int) -> tuple[list[str], list[dict]]:
    """The printed lines (head, floor line, one per case and head count) and
    the JSON rows of timed ``cases`` (the first is the floor)."""
    shown = [n for n in NAMES if any(n in c["times"] and c["times"][n][0] for c in cases)]
    head = f"{'case':16} {'heads':>5} {'rows':>5} {'same':>4} " + " ".join(
        f"{n + ' replay':>22} {n + ' /copy':>19}" for n in shown)
    flat, fper = cases[0]["times"]["floor"]
    lines = [f"\nµs, median over {rounds} rounds [min-max of the rounds]; replay = one graph "
             f"replay, L2 flushed; /copy = {COPIES} copies in one graph, per copy",
             f"floor (one-element add_): replay {statistics.median(flat):.1f} "
             f"[{min(flat):.1f}-{max(flat):.1f}], /copy {statistics.median(fper):.2f}",
             head]
    results = []
    for case in cases[1:]:
        row = dict(case=case["case"], heads=case["heads"], rows=case["rows"],
                   bitwise_equal=case["same"])
        cells = []
        for n in shown:
            if n not in case["times"] or not case["times"][n][0]:
                cells.append(f"{'-':>22} {'-':>19}")
                continue
            lat, per = case["times"][n]
            row[n] = dict(replay_us=lat, per_copy_us=per)
            cells.append(f"{statistics.median(lat):8.1f} [{min(lat):5.1f}-{max(lat):5.1f}] "
                         f"{statistics.median(per):6.2f} [{min(per):4.1f}-{max(per):4.1f}]")
        results.append(row)
        lines.append(f"{case['case']:16} {case['heads']:5d} {case['rows']:5d} "
                     f"{'yes' if case['same'] else 'NO':>4} " + " ".join(cells))
    return lines, results


def prepare_case(torch, text: str, heads: int, rows, max_len: int, width: int, native,
                 sms: int, dg) -> dict:
    """One timed row: the step's schedule at ``heads`` by ``plan_torch`` and
    by the planner (its output into poisoned buffers, compared bit for bit
    first), without and (``planner_cut``, where the head count has one) with
    the serving plan's small-step cut (``plan``'s ``cut_items``), and, with
    ``dg``, DeepGEMM's metadata, each captured in graphs of one and
    :data:`COPIES` copies."""
    from ..ops import cuda_paged_mqa_logits as ck
    from ..ops import cuda_plan as cp

    ids, ctx = rows.indices, rows.context_lens
    ctx2d = ctx.view(-1, 1)
    out = cp.allocate(ids.shape[0], sms, "cuda")
    paths = {"plan_torch": lambda: ck.plan_torch(ids, ctx2d, max_len, width, heads)}
    same = True
    cut = ck.cut_items_for(heads, sms)
    for name, cut_items in [("planner", 0)] + ([("planner_cut", cut)] if cut else []):
        want = ck.plan_torch(ids, ctx2d, max_len, width, heads, cut_items=cut_items)
        for t in out:
            t.fill_(-7)  # poisoned: every word must be written
        got = cp.plan_device(ids, ctx, max_len, width, heads=heads, out=out, cut_items=cut_items)
        same = same and all(torch.equal(a, b) for a, b in zip(want, got))
        paths[name] = lambda c=cut_items: cp.plan_device(ids, ctx, max_len, width, heads=heads,
                                                         out=out, cut_items=c)
    if not same:
        print(f"# MISMATCH on {text} at {heads} heads: planner output differs from plan_torch")
    if dg is not None:
        flat = ctx2d.contiguous()
        paths["dg_meta_flat"] = lambda: dg.get_paged_mqa_logits_metadata(flat, 64, sms)
        if native is not None:
            paths["dg_meta_native"] = lambda: dg.get_paged_mqa_logits_metadata(native, 64, sms)
    graphs = {}
    for name, fn in paths.items():
        try:
            graphs[name] = (graph_of(torch, fn, 1), graph_of(torch, fn, COPIES))
        except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
            print(f"# {text} {name}: {type(exc).__name__}: {exc}")
    return dict(case=text, heads=heads, rows=ids.shape[0], same=same, graphs=graphs,
                times={name: ([], []) for name in graphs})


def run(args) -> int:
    """The ``--plan-timing`` mode (``args``: ``cases``, ``heads``, ``rounds``,
    ``rep_ms``, ``json``); 0, or 1 when a planner output differs from
    ``plan_torch``."""
    import torch
    from triton.testing import do_bench

    from ..ops import cuda_plan as cp
    from ..ops.common import num_sms

    texts = args.cases or CASES
    parsed = [parse_case(t) for t in texts]
    heads_timed = head_counts(getattr(args, "heads", None))
    rounds = ROUNDS if args.rounds is None else args.rounds
    if rounds < 1:
        raise ValueError(f"--rounds: expected an int >= 1, got {rounds}")
    if not torch.cuda.is_available():
        raise SystemExit("--plan-timing: needs a CUDA GPU (it times the planner's launch)")
    rep_ms = args.rep_ms or REP_MS
    sms = num_sms(torch.device("cuda"))
    dg_name, dg = import_deepgemm()
    print(f"# {torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}, "
          f"DeepGEMM: {dg_name or 'not importable'}")
    for heads in heads_timed:
        cp.load("cuda", heads)

    z = torch.zeros(1, device="cuda")
    floor = {"floor": (graph_of(torch, lambda: z.add_(1), 1),
                       graph_of(torch, lambda: z.add_(1), COPIES))}
    cases = [dict(case="floor (add_)", heads=0, rows=0, same=True, graphs=floor,
                  times={"floor": ([], [])})]
    for text, (reqs, tokens, context) in zip(texts, parsed):
        rows, max_len, width, native = step_rows(torch, reqs, tokens, context)
        for heads in heads_timed:  # DeepGEMM's metadata takes no head count: timed once
            cases.append(prepare_case(torch, text, heads, rows, max_len, width, native, sms,
                                      dg if heads == heads_timed[0] else None))

    for _ in range(rounds):
        for case in cases:
            for name, (one, many) in case["graphs"].items():
                lat = do_bench(one.replay, warmup=10, rep=rep_ms, return_mode="median") * 1e3
                per = do_bench(many.replay, warmup=5, rep=rep_ms,
                               return_mode="median") * 1e3 / COPIES
                case["times"][name][0].append(lat)
                case["times"][name][1].append(per)

    lines, results = format_table(cases, rounds)
    if args.json:
        flat, fper = cases[0]["times"]["floor"]
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), sms=sms, deepgemm=dg_name,
                           heads=list(heads_timed), rounds=rounds, copies=COPIES, results=results,
                           floor=dict(replay_us=flat, per_copy_us=fper)), f, indent=1)
    print("\n".join(lines))
    return 0 if all(c["same"] for c in cases) else 1  # the floor row is always "same"
