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
// Shape: THREADS threads, thread t owns the rows [t K, t K + K), K = ceil(R /
// THREADS), so every step is one CTA and a fixed number of block-wide scans
// whatever its row count:
//   1. run starts (forward max) and run ends (backward min) across threads;
//   2. per row its run's first and last row, KV length, chunk, items and cost;
//      exclusive sums of items, chunks with work and cost across threads;
//   3. per row its place in the table and its first item, written; the chunk
//      where CTA c's share starts (the c with c * C / P in its cost range,
//      found by division, no search) tags c's slot in shared memory;
//   4. CTA c takes the last tag at or before c (a max scan over c) and its
//      item offset; its hi is CTA c + 1's lo.
// Grid and shared memory are fixed (graph safe); the step's facts never leave
// the GPU.

typedef long long i64;

#define THREADS 1024
#define WARPS (THREADS / 32)
#define ROWS_MAX 4            // rows per chunk: the logits kernel's two row groups of two
#define PAGE 64
#define MAX_PROGRAMS THREADS  // one thread per CTA in step 4
#define FULL 0xffffffffu
#define DEV __device__ __forceinline__

DEV int lane_id() { return threadIdx.x & 31; }
DEV int warp_id() { return threadIdx.x >> 5; }

// ---------------------------------------------------------------- block scans

// Exclusive forward max of a and exclusive backward min of b over the block's
// threads (thread 0 gets a_id, the last thread b_id).
DEV void scan_start_end(int& a, int& b, int a_id, int b_id, int* buf) {
  const int lane = lane_id(), warp = warp_id();
  int ia = a, ib = b;
#pragma unroll
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
#pragma unroll
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

// Exclusive sums of three counters over the block's threads, and their totals.
DEV void scan_sums(i64 (&v)[3], i64 (&total)[3], i64* buf) {
  const int lane = lane_id(), warp = warp_id();
  i64 inc[3];
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    inc[k] = v[k];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const i64 o = __shfl_up_sync(FULL, inc[k], d);
      if (lane >= d) inc[k] += o;
    }
    if (lane == 31) buf[k * (WARPS + 1) + warp] = inc[k];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      i64 x = buf[k * (WARPS + 1) + lane];
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const i64 o = __shfl_up_sync(FULL, x, d);
        if (lane >= d) x += o;
      }
      __syncwarp();
      buf[k * (WARPS + 1) + lane] = x - buf[k * (WARPS + 1) + lane];
      if (lane == 31) buf[k * (WARPS + 1) + WARPS] = x;
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    v[k] = buf[k * (WARPS + 1) + warp] + inc[k] - v[k];
    total[k] = buf[k * (WARPS + 1) + WARPS];
  }
}

// Inclusive forward max over the block's threads.
DEV int scan_max(int a, int* buf) {
  const int lane = lane_id(), warp = warp_id();
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int o = __shfl_up_sync(FULL, a, d);
    if (lane >= d) a = max(a, o);
  }
  if (lane == 31) buf[warp] = a;
  __syncthreads();
  if (warp == 0) {
    int x = buf[lane];
#pragma unroll
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

DEV bool run_start(const int* ids, int r) { return r == 0 || __ldg(ids + r) != __ldg(ids + r - 1); }
DEV bool run_end(const int* ids, int r, int rows) {
  return r == rows - 1 || __ldg(ids + r) != __ldg(ids + r + 1);
}

// One row's facts.  A thread walks its rows forward, carrying its run's first
// row and the next run end at or after the row (`last`; the first end past
// the thread's rows comes from step 1).
struct Row { int first, last, kv, n_rows, items; i64 unit; };

struct Walk {
  const int* ids; const int* ctx; int rows, r1, cap, first, last, last_after;
  i64 c0, c1, c2;

  DEV Row at(int r) {
    if (run_start(ids, r)) first = r;
    if (last < r) {
      last = r;
      while (last < r1 && !run_end(ids, last, rows)) ++last;
      if (last == r1) last = last_after;
    }
    Row w;
    w.first = first;
    w.last = last;
    w.kv = min(max(__ldg(ctx + last), 0), cap);
    w.n_rows = min(last - r + 1, ROWS_MAX);
    const bool work = (r - first) % ROWS_MAX == 0 && w.kv > 0;
    w.items = work ? (w.kv + PAGE - 1) / PAGE : 0;
    w.unit = work ? c0 + c1 * w.n_rows + c2 * ((w.n_rows + 1) / 2) : 0;
    return w;
  }
};

DEV i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }

extern "C" __global__ void __launch_bounds__(THREADS, 1)
plan_sm90(const int* __restrict__ ids, const int* __restrict__ ctx, int rows, int cap,
          int programs, i64 c0, i64 c1, i64 c2, int* __restrict__ table, int* __restrict__ ctas) {
  __shared__ int s_scan[2 * WARPS];
  __shared__ i64 s_sums[3 * (WARPS + 1)];
  __shared__ int s_max[WARPS];
  __shared__ int tag_seg[MAX_PROGRAMS];   // CTA c's first segment, where c's share starts in it
  __shared__ int tag_off[MAX_PROGRAMS];   // that segment's first item
  __shared__ i64 tag_cost[MAX_PROGRAMS];  // its cost offset
  __shared__ i64 tag_unit[MAX_PROGRAMS];  // its cost per item
  __shared__ int s_lo[MAX_PROGRAMS];

  const int t = threadIdx.x;
  if (t < programs) tag_seg[t] = -1;
  const int per = (rows + THREADS - 1) / THREADS;
  const int r0 = min(t * per, rows), r1 = min(r0 + per, rows);

  // 1. the last run start in this thread's rows, the first run end
  int start_before = -1, end_after = rows;
  for (int r = r0; r < r1; ++r) {
    if (run_start(ids, r)) start_before = r;
    if (end_after == rows && run_end(ids, r, rows)) end_after = r;
  }
  scan_start_end(start_before, end_after, -1, rows, s_scan);

  // 2. items, chunks with work, cost: this thread's sums, then the block's
  Walk walk{ids, ctx, rows, r1, cap, start_before, -1, end_after, c0, c1, c2};
  i64 sums[3] = {0, 0, 0}, totals[3];
  for (int r = r0; r < r1; ++r) {
    const Row w = walk.at(r);
    sums[0] += w.items;
    sums[1] += w.items > 0;
    sums[2] += w.unit * w.items;
  }
  const i64 thread_cost = sums[2];
  scan_sums(sums, totals, s_sums);
  const int total_items = (int)totals[0], with_work = (int)totals[1];
  const i64 cost = totals[2];

  // 3. table rows; the chunks where CTAs' shares start tag them.  A CTA c's
  // share starts in the chunk whose cost range [a, b) holds c * C / P, so
  // c runs from ceil(a P / C) to ceil(b P / C) - 1; only threads whose cost
  // range holds some share's start divide per chunk.
  const bool tags = cost > 0 && ceil_div(sums[2] * programs, cost)
                                    < ceil_div((sums[2] + thread_cost) * programs, cost);
  walk.first = start_before;
  walk.last = -1;
  i64 item = sums[0], seg_cost = sums[2];
  int seg = (int)sums[1];
  for (int r = r0; r < r1; ++r) {
    const Row w = walk.at(r);
    const bool work = w.items > 0;
    const int pos = work ? seg : with_work + (r - seg);
    const int off = work ? (int)item : total_items;
    int4* dst = reinterpret_cast<int4*>(table + 8 * (i64)pos);
    dst[0] = make_int4(r, w.n_rows, w.kv, off);
    dst[1] = make_int4(w.items, w.first, 0, 0);
    if (work) {
      const i64 end = seg_cost + w.unit * w.items;
      if (tags) {
        const i64 c = ceil_div(seg_cost * programs, cost);
        if (c < ceil_div(end * programs, cost)) {
          tag_seg[c] = pos;
          tag_off[c] = off;
          tag_cost[c] = seg_cost;
          tag_unit[c] = w.unit;
        }
      }
      item += w.items;
      seg_cost = end;
      ++seg;
    }
  }
  __syncthreads();

  // 4. CTA c: its share's first item, its first segment; hi is CTA c + 1's lo
  const int tagged = scan_max(t < programs && tag_seg[t] >= 0 ? t : -1, s_max);
  int lo = total_items, seg0 = rows;  // no work: every range empty, past every segment
  if (t < programs && cost > 0) {
    const i64 x = (i64)t * cost / programs;
    lo = (int)(tag_off[tagged] + (x - tag_cost[tagged]) / tag_unit[tagged]);
    seg0 = tag_seg[tagged];
  }
  if (t < programs) s_lo[t] = lo;
  __syncthreads();
  if (t < programs) {
    const int hi = t + 1 < programs ? s_lo[t + 1] : total_items;
    reinterpret_cast<int4*>(ctas)[t] = make_int4(seg0, lo, hi, 0);
  }
}
