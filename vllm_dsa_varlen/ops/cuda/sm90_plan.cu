// The sm_90 logits kernel's per-step schedule (sm90_varlen_logits.cu reads it)
// in one launch of one CTA.  Loaded by vllm_dsa_varlen/ops/cuda_plan.py (NVRTC,
// sm_90a), which documents the inputs; cuda_paged_mqa_logits.plan_torch (torch
// operations) defines the output, bit for bit:
//
//   table int32 [R, 8]: per row r, (r, rows, KV length, first item, items,
//     run's first row, 0, 0); rows where a chunk with pages starts come first
//     (in row order), then the rest (first item = the step's item total, no
//     items);
//   ctas int32 [P, 4]: (first segment, item range lo, hi, 0) of CTA c: the
//     items whose cost ends past c * C / P and starts before (c + 1) * C / P.
//
// One build per head count of the logits kernel (HEADS: 64, the default, or
// 32): it sets the chunk, ROWS_MAX = two row groups of 128 / HEADS rows (4 or
// 8), hence where chunks start and how many page costs (one per chunk size)
// the launcher passes.
//
// Shape: THREADS threads, thread t owns the rows [t K, t K + K), K = ceil(R /
// THREADS) <= 32, so every step is one CTA and a fixed number of block-wide
// scans whatever its row count.  A thread reads its rows' ids once, into two
// bit masks (run starts, run ends); a row's run bounds are bit operations on
// them.
//   1. run starts (forward max) and run ends (backward min) across threads;
//      1b. where the launcher passes cut_items and the step's items are at
//      most that, runs over both row groups of a chunk are cut into row groups (one
//      more block-wide sum; cuda_paged_mqa_logits.plan_torch);
//   2. per row its run's first and last row, KV length, chunk, items and cost;
//      exclusive sums of items, chunks with work and cost across threads;
//   3. per row its place in the table and its first item, written; the chunk
//      where CTA c's share starts (the c with c * C / P in its cost range)
//      tags c's slot in shared memory;
//   4. CTA c takes the last tag at or before c (a max scan over c) and its
//      item offset; its hi is CTA c + 1's lo.
//
// It runs once per launch, on one SM, its code fetched cold: so the loops stay
// rolled and the two walks over a thread's rows share one copy of the code.
// Neighbouring threads' table rows are K rows apart (an L2 request per 16-byte
// store), so steps of up to TABLE_ROWS rows build the table in shared memory
// and copy it out coalesced.  Steps of up to STAGE_ROWS rows copy the ids and
// context lengths to shared memory first (coalesced; one padding word per 32 so
// the threads' strided reads hit distinct banks); larger steps read them from
// global memory.  Dynamic shared memory is a function of the row count alone,
// the grid is fixed (graph safe); the step's facts never leave the GPU.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

#ifndef HEADS
#define HEADS 64              // the logits kernel's heads (its HEADS build): 64 or 32
#endif
static_assert(HEADS == 64 || HEADS == 32, "the logits kernel serves 64 or 32 heads");

#define THREADS 1024
#define WARPS (THREADS / 32)
#define GROUP_ROWS (128 / HEADS)   // rows per row group: its wgmma's 128 columns are rows x heads
#define ROWS_MAX (2 * GROUP_ROWS)  // rows per chunk: the logits kernel's two row groups
#define PAGE 64
#define MAX_PROGRAMS THREADS  // one thread per CTA in step 4
#define STAGE_ROWS 8192       // rows staged in shared memory (ids, context lengths)
#define TABLE_ROWS 4096       // rows whose table is built in shared memory
#define FULL 0xffffffffu
#define DEV __device__ __forceinline__
static_assert((ROWS_MAX & (ROWS_MAX - 1)) == 0, "chunk starts are found with a mask");

DEV int lane_id() { return threadIdx.x & 31; }
DEV int warp_id() { return threadIdx.x >> 5; }

// ---------------------------------------------------------------- block scans

// Exclusive forward max of a and exclusive backward min of b over the block's
// threads (thread 0 gets a_id, the last thread b_id).
DEV void scan_start_end(int& a, int& b, int a_id, int b_id, int* buf) {
  const int lane = lane_id(), warp = warp_id();
  int ia = a, ib = b;
#pragma unroll 1
  for (int d = 1; d < 32; d <<= 1) {
    const int oa = __shfl_up_sync(FULL, ia, d), ob = __shfl_down_sync(FULL, ib, d);
    if (lane >= d) ia = max(ia, oa);
    if (lane + d < 32) ib = min(ib, ob);
  }
  int* wa = buf;            // [WARPS] per warp: max of the warps before it
  int* wb = buf + WARPS;    // [WARPS] per warp: min of the warps after it
  if (lane == 31) wa[warp] = ia;
  if (lane == 0) wb[warp] = ib;
  __syncthreads();
  if (warp == 0) {
    int xa = wa[lane], xb = wb[lane];
#pragma unroll 1
    for (int d = 1; d < 32; d <<= 1) {
      const int oa = __shfl_up_sync(FULL, xa, d), ob = __shfl_down_sync(FULL, xb, d);
      if (lane >= d) xa = max(xa, oa);
      if (lane + d < 32) xb = min(xb, ob);
    }
    const int pa = __shfl_up_sync(FULL, xa, 1), pb = __shfl_down_sync(FULL, xb, 1);
    __syncwarp();
    wa[lane] = lane == 0 ? a_id : pa;
    wb[lane] = lane == 31 ? b_id : pb;
  }
  __syncthreads();
  const int pa = __shfl_up_sync(FULL, ia, 1), pb = __shfl_down_sync(FULL, ib, 1);
  a = max(wa[warp], lane == 0 ? a_id : pa);
  b = min(wb[warp], lane == 31 ? b_id : pb);
}

// Exclusive sums of two counters over the block's threads, and their totals.
DEV void scan_sums(i64& v0, i64& v1, i64& total0, i64& total1, i64* buf) {
  const int lane = lane_id(), warp = warp_id();
  i64 inc0 = v0, inc1 = v1;
#pragma unroll 1
  for (int d = 1; d < 32; d <<= 1) {
    const i64 o0 = __shfl_up_sync(FULL, inc0, d), o1 = __shfl_up_sync(FULL, inc1, d);
    if (lane >= d) { inc0 += o0; inc1 += o1; }
  }
  if (lane == 31) { buf[warp] = inc0; buf[WARPS + 1 + warp] = inc1; }
  __syncthreads();
  if (warp == 0) {
    const i64 own0 = buf[lane], own1 = buf[WARPS + 1 + lane];
    i64 x0 = own0, x1 = own1;
#pragma unroll 1
    for (int d = 1; d < 32; d <<= 1) {
      const i64 o0 = __shfl_up_sync(FULL, x0, d), o1 = __shfl_up_sync(FULL, x1, d);
      if (lane >= d) { x0 += o0; x1 += o1; }
    }
    buf[lane] = x0 - own0;
    buf[WARPS + 1 + lane] = x1 - own1;
    if (lane == 31) { buf[WARPS] = x0; buf[2 * WARPS + 1] = x1; }
  }
  __syncthreads();
  v0 = buf[warp] + inc0 - v0;
  v1 = buf[WARPS + 1 + warp] + inc1 - v1;
  total0 = buf[WARPS];
  total1 = buf[2 * WARPS + 1];
}

// Inclusive forward max over the block's threads.
DEV int scan_max(int a, int* buf) {
  const int lane = lane_id(), warp = warp_id();
#pragma unroll 1
  for (int d = 1; d < 32; d <<= 1) {
    const int o = __shfl_up_sync(FULL, a, d);
    if (lane >= d) a = max(a, o);
  }
  if (lane == 31) buf[warp] = a;
  __syncthreads();
  if (warp == 0) {
    int x = buf[lane];
#pragma unroll 1
    for (int d = 1; d < 32; d <<= 1) {
      const int o = __shfl_up_sync(FULL, x, d);
      if (lane >= d) x = max(x, o);
    }
    const int p = __shfl_up_sync(FULL, x, 1);
    __syncwarp();
    buf[lane] = lane == 0 ? -1 : p;
  }
  __syncthreads();
  return max(a, buf[warp]);
}

// ---------------------------------------------------------------- rows

// Staged row i's word: one padding word per 32 (bank-conflict free reads at a
// stride of K rows per thread).
DEV int pad(int i) { return i + (i >> 5); }
// The shared-memory table's 16-byte slot of its 16-byte chunk q (two per row):
// one padding slot per 8, so the threads' strided writes spread over the banks.
DEV int slot(int q) { return q + (q >> 3); }

// The step's ids and context lengths: staged in shared memory or in global.
struct Src {
  const int* ids_g; const int* ctx_g; const int* ids_s; const int* ctx_s; bool staged;
  DEV int id(int r) const { return staged ? ids_s[pad(r)] : __ldg(ids_g + r); }
  DEV int ctx(int r) const { return staged ? ctx_s[pad(r)] : __ldg(ctx_g + r); }
};

// One value per chunk size n = 1 .. ROWS_MAX (a page's cost in a chunk of n
// rows, the launcher's page_cost, and its division magic): a kernel parameter,
// read at constant indices only (a select chain), so it stays out of local
// memory.
template <typename T> struct ByRows {
  T v[ROWS_MAX];
  DEV T at(int n) const {  // v[n - 1], 1 <= n <= ROWS_MAX
    T x = v[ROWS_MAX - 1];
#pragma unroll
    for (int i = ROWS_MAX - 2; i >= 0; --i) x = n == i + 1 ? v[i] : x;
    return x;
  }
};

// One row's facts.
struct Row { int first, last, kv, n_rows, items; i64 unit; };

// A thread's rows r0 + k (k < n <= 32): bit k of `starts` / `ends` is set
// where a run starts / ends; the last run start before r0 and the first run
// end at or past r0 + n come from step 1.  The KV length is the last row's of
// the step's own run (`kv_ends`, `kv_end_after`: the run ends before any cut,
// step 1b), kept while rows share it.
struct Rows {
  Src src; int r0, cap, first_before, end_after; u32 starts, ends;
  ByRows<i64> unit;  // a page's cost in a chunk of 1 .. ROWS_MAX rows
  int kv_row, kv;
  u32 kv_ends; int kv_end_after;

  DEV int first(int k) const {
    const u32 below = starts & (0xffffffffu >> (31 - k));  // starts at or before r0 + k
    return below ? r0 + 31 - __clz(below) : first_before;
  }
  DEV Row at(int k) {
    const int r = r0 + k;
    const u32 above = ends >> k;                            // ends at or past r
    Row w;
    w.first = first(k);
    w.last = above ? r + __ffs(above) - 1 : end_after;
    const u32 kv_above = kv_ends >> k;
    const int run_last = kv_above ? r + __ffs(kv_above) - 1 : kv_end_after;
    if (run_last != kv_row) { kv_row = run_last; kv = min(max(src.ctx(run_last), 0), cap); }
    w.kv = kv;
    w.n_rows = min(w.last - r + 1, ROWS_MAX);
    const bool work = ((r - w.first) & (ROWS_MAX - 1)) == 0 && w.kv > 0;
    w.items = work ? (int)((u32)(w.kv + PAGE - 1) / PAGE) : 0;  // kv > 0 here
    w.unit = !work ? 0 : unit.at(w.n_rows);
    return w;
  }
};

// floor(a / d) for 0 <= a < 2^63, d > 0, given magic = floor((2^64 - 1) / d)
// (the launcher's): the high word of a * magic is floor(a / d) or up to 2 less.
DEV i64 div_by(i64 a, i64 d, u64 magic) {
  i64 q = (i64)__umul64hi((u64)a, magic);
  while ((q + 1) * d <= a) ++q;
  return q;
}

// The first CTA whose share starts at or past cost a: the least c >= 0 with
// c * cost >= a * programs, i.e. ceil(a * programs / cost) <= programs: a
// float estimate (relative error ~1e-7, so off by at most one) made exact by
// integer checks.
DEV i64 first_cta_at(i64 a, i64 programs, i64 cost, float ratio) {
  const i64 ap = a * programs;
  i64 c = (i64)ceilf((float)a * ratio);
  while (c > 0 && (c - 1) * cost >= ap) --c;
  while (c * cost < ap) ++c;
  return c;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
plan_sm90(const int* __restrict__ ids_g, const int* __restrict__ ctx_g, int rows, int cap,
          int programs, int cut_items, ByRows<i64> unit, u64 magic_p, ByRows<u64> magic,
          int* __restrict__ table, int* __restrict__ ctas) {
  // dynamic: ids, context lengths (pad) when rows <= STAGE_ROWS; the table
  // (slot) when rows <= TABLE_ROWS
  extern __shared__ __align__(16) int stage[];
  __shared__ int s_scan[2 * WARPS];
  __shared__ i64 s_sums[2 * (WARPS + 1)];
  __shared__ int s_max[WARPS];
  __shared__ int tag_seg[MAX_PROGRAMS];   // CTA c's first segment, where c's share starts in it
  __shared__ int tag_off[MAX_PROGRAMS];   // that segment's first item
  __shared__ i64 tag_cost[MAX_PROGRAMS];  // its cost offset
  __shared__ int tag_rows[MAX_PROGRAMS];  // its rows (its cost per item: unit.at(rows))
  __shared__ int s_lo[MAX_PROGRAMS];

  const int t = threadIdx.x;
  if (t < programs) tag_seg[t] = -1;
  const bool staged = rows <= STAGE_ROWS;
  int* ids_s = stage;
  int* ctx_s = stage + pad(rows) + 1;
  int4* table_s = reinterpret_cast<int4*>(stage + ((2 * (pad(rows) + 1) + 3) & ~3));
  const bool table_in_smem = rows <= TABLE_ROWS;
  if (staged) {  // four rows in flight per thread and step
#pragma unroll 1
    for (int i = t; i < rows; i += 4 * THREADS) {
      int vi[4], vc[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (i + k * THREADS < rows) {
          vi[k] = __ldg(ids_g + i + k * THREADS);
          vc[k] = __ldg(ctx_g + i + k * THREADS);
        }
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (i + k * THREADS < rows) {
          ids_s[pad(i + k * THREADS)] = vi[k];
          ctx_s[pad(i + k * THREADS)] = vc[k];
        }
      }
    }
    __syncthreads();
  }
  Src src{ids_g, ctx_g, ids_s, ctx_s, staged};
  const int per = (rows + THREADS - 1) / THREADS;  // <= 32 (the launcher's check)
  const int r0 = min(t * per, rows), r1 = min(r0 + per, rows), n = r1 - r0;

  // 1. this thread's run starts and ends (bit masks); the last start in its
  // rows, the first end; across threads, the last start before its rows and
  // the first end past them
  u32 starts = 0, ends = 0;
  if (n > 0) {
    int prev = r0 > 0 ? src.id(r0 - 1) : 0, cur = src.id(r0);
#pragma unroll 1
    for (int k = 0; k < n; ++k) {
      const int r = r0 + k;
      const int next = r + 1 < rows ? src.id(r + 1) : 0;
      if (r == 0 || cur != prev) starts |= 1u << k;
      if (r == rows - 1 || cur != next) ends |= 1u << k;
      prev = cur;
      cur = next;
    }
  }
  int start_before = starts ? r0 + 31 - __clz(starts) : -1;
  int end_after = ends ? r0 + __ffs(ends) - 1 : rows;
  scan_start_end(start_before, end_after, -1, rows, s_scan);

  // 2. items and chunks with work (packed: items << 16 | chunks, at most
  // 32768 chunks), cost: this thread's sums, then the block's exclusive sums;
  // 3. the table rows, and the chunks where CTAs' shares start tag them.  A
  // CTA c's share starts in the chunk whose cost range [a, b) holds c * C /
  // P, so c runs from ceil(a P / C) to ceil(b P / C) - 1; only threads whose
  // cost range holds some share's start look per chunk.  One walk over the
  // thread's rows serves both passes (one copy of its code).
  Rows walk{src, r0, cap, start_before, end_after, starts, ends, unit, -1, 0, ends, end_after};

  // 1b. small steps (cut_items > 0 and the step's items, its chunks' pages,
  // at most that): every run of more than GROUP_ROWS and at most ROWS_MAX
  // rows (one chunk over both row groups) becomes runs of GROUP_ROWS rows,
  // the last the shorter (a CTA item per row group),
  // each with its run's KV length (so each row is masked as before).  The
  // decision is block-wide (one sum); the cut bits are the thread's own, its
  // carries derived from the uncut ones.
  if (cut_items > 0) {
    i64 mine = 0, none = 0, items_total = 0, none_total = 0;
#pragma unroll 1
    for (int k = 0; k < n; ++k)
      if (((r0 + k - walk.first(k)) & (ROWS_MAX - 1)) == 0) mine += walk.at(k).items;
    scan_sums(mine, none, items_total, none_total, s_sums);
    if (items_total <= cut_items) {
      u32 cut_starts = starts, cut_ends = ends;
      int last_first = start_before, last_last = end_after;
#pragma unroll 1
      for (int k = 0; k < n; ++k) {
        const Row w = walk.at(k);
        const int len = w.last - w.first + 1, pos = r0 + k - w.first;
        if (len > GROUP_ROWS && len <= ROWS_MAX) {
          if (pos % GROUP_ROWS == 0) cut_starts |= 1u << k;
          if (pos % GROUP_ROWS == GROUP_ROWS - 1) cut_ends |= 1u << k;
        }
        last_first = w.first;
        last_last = w.last;
      }
      if (n > 0) {
        // the run going on into this thread's rows from before r0 (its first:
        // start_before; read only where r0 starts no run): the piece holding r0
        if (start_before >= 0 && !(starts & 1u)) {
          const int f = start_before, len = walk.at(0).last - f + 1;
          if (len > GROUP_ROWS && len <= ROWS_MAX)
            start_before = f + (r0 - f) / GROUP_ROWS * GROUP_ROWS;
        }
        // the run holding row r0 + n - 1, where it goes on past this thread
        const int len = last_last - last_first + 1;
        if (last_last >= r0 + n && len > GROUP_ROWS && len <= ROWS_MAX)
          end_after = min(last_first + ((r0 + n - 1 - last_first) / GROUP_ROWS + 1) * GROUP_ROWS - 1,
                          last_last);
      }
      starts = cut_starts;
      ends = cut_ends;
      walk = Rows{src, r0, cap, start_before, end_after, starts, ends, unit, -1, 0, walk.kv_ends,
                  walk.kv_end_after};
    }
  }

  i64 packed = 0, seg_cost = 0, thread_cost = 0, totals = 0, cost = 0;
  int total_items = 0, with_work = 0, seg = 0;
  bool tags = false;
  float ratio = 0.f;
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {
      thread_cost = seg_cost;
      scan_sums(packed, seg_cost, totals, cost, s_sums);
      total_items = (int)(totals >> 16);
      with_work = (int)(totals & 0xffff);
      seg = (int)(packed & 0xffff);
      packed >>= 16;  // from here: this thread's first item
      ratio = cost > 0 ? (float)programs / (float)cost : 0.f;
      tags = thread_cost > 0
          && first_cta_at(seg_cost, programs, cost, ratio)
                 < first_cta_at(seg_cost + thread_cost, programs, cost, ratio);
    }
#pragma unroll 1
    for (int k = 0; k < n; ++k) {
      if (pass == 0 && ((r0 + k - walk.first(k)) & (ROWS_MAX - 1))) continue;  // no chunk
      const Row w = walk.at(k);
      const bool work = w.items > 0;
      if (pass == 0) {
        packed += ((i64)w.items << 16) + work;
        seg_cost += w.unit * w.items;
        continue;
      }
      const int r = r0 + k;
      const int pos = work ? seg : with_work + (r - seg);
      const int off = work ? (int)packed : total_items;
      const int4 lo_half = make_int4(r, w.n_rows, w.kv, off);
      const int4 hi_half = make_int4(w.items, w.first, 0, 0);
      if (table_in_smem) {
        table_s[slot(2 * pos)] = lo_half;
        table_s[slot(2 * pos + 1)] = hi_half;
      } else {
        reinterpret_cast<int4*>(table)[2 * (i64)pos] = lo_half;
        reinterpret_cast<int4*>(table)[2 * (i64)pos + 1] = hi_half;
      }
      if (work) {
        const i64 end = seg_cost + w.unit * w.items;
        if (tags) {
          const i64 c = first_cta_at(seg_cost, programs, cost, ratio);
          if (c < first_cta_at(end, programs, cost, ratio)) {
            tag_seg[c] = pos;
            tag_off[c] = off;
            tag_cost[c] = seg_cost;
            tag_rows[c] = w.n_rows;
          }
        }
        packed += w.items;
        seg_cost = end;
        ++seg;
      }
    }
  }
  __syncthreads();
  if (table_in_smem) {  // coalesced copy out
#pragma unroll 1
    for (int q = t; q < 2 * rows; q += THREADS)
      reinterpret_cast<int4*>(table)[q] = table_s[slot(q)];
  }

  // 4. CTA c: its share's first item, its first segment; hi is CTA c + 1's lo
  const int tagged = scan_max(t < programs && tag_seg[t] >= 0 ? t : -1, s_max);
  int lo = total_items, seg0 = rows;  // no work: every range empty, past every segment
  if (t < programs && cost > 0) {
    const int n_rows = tag_rows[tagged];
    const i64 x = div_by((i64)t * cost, programs, magic_p);
    lo = (int)(tag_off[tagged] + div_by(x - tag_cost[tagged], unit.at(n_rows), magic.at(n_rows)));
    seg0 = tag_seg[tagged];
  }
  if (t < programs) s_lo[t] = lo;
  __syncthreads();
  if (t < programs) {
    const int hi = t + 1 < programs ? s_lo[t + 1] : total_items;
    reinterpret_cast<int4*>(ctas)[t] = make_int4(seg0, lo, hi, 0);
  }
}
