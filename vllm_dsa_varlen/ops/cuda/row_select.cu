// The indexer's decode top-k over many CTAs per row, in two launches that
// read the logits once each: row_hist, then row_select.  Loaded by
// vllm_dsa_varlen/ops/cuda_select.py (NVRTC, sm_90a), which checks the
// inputs, zeroes the workspace and picks the build (ITEMS); the result is
// ops/reference.py's topk_first_ties: per row r the columns of the k largest
// of logits[r, 0 : len[r]] (fp32), of the keys tied at the k-th value the
// lowest columns; a row with len <= k gets 0 .. len - 1 and then -1.
// Written in column order of the winners above the k-th value's bin, then
// the rest; bitwise the same on every run.
//
// Keys are the logits' order-preserving 32-bit images (negative floats
// bit-flipped, positive ones with the sign bit set).  A row is cut into
// slices of SLICE columns, one CTA each (grid rows x slices):
//   row_hist    each CTA counts its slice's keys by their top 11 bits in
//               shared memory and adds the counts to the row's histogram in
//               global memory.  (The logits kernel's epilogue can make this
//               histogram while it scores: the launch goes away then.)
//   row_select  every CTA finds the bin holding the row's k-th largest key
//               from that histogram (`above` keys in higher bins, `in_bin`
//               in it), counts its slice's keys above and in the bin (held in
//               registers, ITEMS per thread, contiguous), publishes the two
//               counts and sums those of the slices before it (a look-back
//               over lower CTA indices, which the hardware starts first), and
//               writes its winners at their column-order slots.  Where the
//               bin holds exactly the keys still needed they are winners too;
//               otherwise they go, in column order, to a candidate list
//               (CAP per row), and the row's last CTA (a ticket) narrows the
//               list by the next 11 and 10 bits and writes the rest.  A bin of
//               more than CAP keys is narrowed over the row instead (right
//               for any values, slow: many equal or near-equal logits).
// Nothing leaves the GPU; the workspace (histograms, slice counts, tickets)
// is zero on entry.

typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#ifndef ITEMS
#define ITEMS 16                  // columns per thread in a slice: 4, 8 or 16
#endif
#if !(ITEMS == 4 || ITEMS == 8 || ITEMS == 16)
#error "ITEMS is 4, 8 or 16 (cuda_select.ITEMS_BUILDS)"
#endif
#define THREADS 512
#define WARPS (THREADS / 32)
#define SLICE (THREADS * ITEMS)   // columns per CTA
#define BINS 2048
#define BPT (BINS / THREADS)      // bins per thread in the bin search
#define TOP 21                    // key >> TOP: the first digit (11 bits)
#define CAP 8192                  // listed candidates per row (the launcher's CAP)
#define READY (1ull << 63)        // a slice's published counts: READY | eq << 32 | hi
#define FULL 0xffffffffu

__device__ __forceinline__ u32 order_key(float x) {
  const u32 b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ int row_length(const int* __restrict__ lens, int r, int width) {
  const int n = lens[r];
  return n < 0 ? 0 : n > width ? width : n;
}

__device__ __forceinline__ void publish(u64* p, u64 v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 observe(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Exclusive prefix of `v` over the CTA's threads in index order; `total`
// gets the sum.  Every thread calls it; `warp_sums` (WARPS values) is free
// again when it returns.
template <class T>
__device__ __forceinline__ T scan_threads(T v, T* __restrict__ warp_sums, T& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T incl = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const T u = __shfl_up_sync(FULL, incl, d);
    if (lane >= d) incl += u;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  T before = T(0), all = T(0);
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    const T s = warp_sums[w];
    before += w < warp ? s : T(0);
    all += s;
  }
  __syncthreads();
  total = all;
  return before + incl - v;
}

// The bin of `h` (BINS counts) holding the need-th largest key, 1 <= need <=
// the keys counted: sel[0] the bin, sel[1] the keys in higher bins, sel[2]
// the keys in it.  Thread t reads bins BINS-1-BPT*t downwards.
__device__ __forceinline__ void find_bin(const int* __restrict__ h, int need,
                                         u32* __restrict__ warp_sums, int* __restrict__ sel) {
  const int top = BINS - 1 - BPT * (int)threadIdx.x;
  int c[BPT];
  u32 mine = 0;
#pragma unroll
  for (int j = 0; j < BPT; ++j) { c[j] = h[top - j]; mine += (u32)c[j]; }
  u32 total;
  int before = (int)scan_threads<u32>(mine, warp_sums, total);
#pragma unroll
  for (int j = 0; j < BPT; ++j) {
    if (before < need && before + c[j] >= need) { sel[0] = top - j; sel[1] = before; sel[2] = c[j]; }
    before += c[j];
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(THREADS, 2)
row_hist(const float* __restrict__ logits, i64 row_stride, const int* __restrict__ lens,
         int width, int k, int slices, int* __restrict__ hist) {
  __shared__ int h[BINS];
  const int r = blockIdx.x / slices, q = blockIdx.x % slices, t = threadIdx.x;
  const int n = row_length(lens, r, width);
  const i64 lo = (i64)q * SLICE;
  if (n <= k || lo >= n) return;               // short rows need no histogram
  const int m = (int)min((i64)SLICE, (i64)n - lo);
  for (int i = t; i < BINS; i += THREADS) h[i] = 0;
  __syncthreads();
  const float* __restrict__ row = logits + (i64)r * row_stride + lo;
  const bool aligned = (reinterpret_cast<u64>(row) & 15) == 0;
#pragma unroll
  for (int it = 0; it < ITEMS / 4; ++it) {    // float4 a thread, the CTA's columns in order
    const int i = 4 * (it * THREADS + t);
    if (aligned && i + 3 < m) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(row + i));
      atomicAdd(&h[order_key(v.x) >> TOP], 1);
      atomicAdd(&h[order_key(v.y) >> TOP], 1);
      atomicAdd(&h[order_key(v.z) >> TOP], 1);
      atomicAdd(&h[order_key(v.w) >> TOP], 1);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (i + j < m) atomicAdd(&h[order_key(__ldg(row + i + j)) >> TOP], 1);
    }
  }
  __syncthreads();
  int* __restrict__ g = hist + (i64)r * BINS;
  for (int i = t; i < BINS; i += THREADS) {
    const int c = h[i];
    if (c) atomicAdd(&g[i], c);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 2)
row_select(const float* __restrict__ logits, i64 row_stride, const int* __restrict__ lens,
           int width, int k, int slices, const int* __restrict__ hist, u64* __restrict__ status,
           int* __restrict__ tickets, u32* __restrict__ cand_keys, int* __restrict__ cand_cols,
           int* __restrict__ out, i64 out_stride) {
  __shared__ int h[BINS];
  __shared__ u64 sums64[WARPS];
  __shared__ u32 sums32[WARPS];
  __shared__ int sel[4];
  __shared__ int last;
  const int r = blockIdx.x / slices, q = blockIdx.x % slices, t = threadIdx.x;
  const int n = row_length(lens, r, width);
  int* __restrict__ orow = out + (i64)r * out_stride;
  if (n <= k) {                                // the same in every CTA of the row
    const int per = (k + slices - 1) / slices;
    const int a = (int)min((i64)q * per, (i64)k), b = min(k, a + per);
    for (int i = a + t; i < b; i += THREADS) orow[i] = i < n ? i : -1;
    return;
  }

  // The bin holding the row's k-th largest key.
  const int* __restrict__ hrow = hist + (i64)r * BINS;
  for (int i = t; i < BINS; i += THREADS) h[i] = hrow[i];
  __syncthreads();
  find_bin(h, k, sums32, sel);
  const u32 bin = (u32)sel[0];
  const int above = sel[1], in_bin = sel[2], need = k - above;
  const bool take_all = in_bin == need;

  // This thread's ITEMS columns (contiguous) and their counts.
  const float* __restrict__ row = logits + (i64)r * row_stride;
  const i64 c0 = (i64)q * SLICE + (i64)t * ITEMS;
  const bool aligned = (reinterpret_cast<u64>(row) & 15) == 0;
  u32 key[ITEMS];
  if (aligned && c0 + ITEMS <= n) {
#pragma unroll
    for (int j = 0; j < ITEMS; j += 4) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(row + c0 + j));
      key[j] = order_key(v.x); key[j + 1] = order_key(v.y);
      key[j + 2] = order_key(v.z); key[j + 3] = order_key(v.w);
    }
  } else {
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) key[j] = c0 + j < n ? order_key(__ldg(row + c0 + j)) : 0u;
  }
  u32 n_hi = 0, n_eq = 0;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const bool valid = c0 + j < n;
    n_hi += valid && (key[j] >> TOP) > bin;
    n_eq += valid && (key[j] >> TOP) == bin;
  }
  u64 slice_total;
  const u64 first = scan_threads<u64>((u64)n_hi | (u64)n_eq << 32, sums64, slice_total);

  // Publish this slice's counts; sum those of the row's slices before it.
  u64* __restrict__ srow = status + (i64)r * slices;
  if (t == 0) publish(&srow[q], READY | slice_total);
  u64 mine = 0;
  for (int p = t; p < q; p += THREADS) {
    u64 v;
    do { v = observe(&srow[p]); } while (!(v & READY));
    mine += v & ~READY;
  }
  u64 before;
  scan_threads<u64>(mine, sums64, before);
  u32 slot_hi = (u32)before + (u32)first;
  u32 slot_eq = (u32)(before >> 32) + (u32)(first >> 32);

  u32* __restrict__ ckeys = cand_keys + (i64)r * CAP;
  int* __restrict__ ccols = cand_cols + (i64)r * CAP;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    if (c0 + j >= n) continue;
    const u32 d = key[j] >> TOP;
    const int col = (int)(c0 + j);
    if (d > bin) {
      orow[slot_hi++] = col;
    } else if (d == bin) {
      if (take_all) orow[above + (int)slot_eq] = col;
      else if (slot_eq < CAP) { ckeys[slot_eq] = key[j]; ccols[slot_eq] = col; }
      ++slot_eq;
    }
  }
  if (take_all) return;

  // The row's last CTA narrows the bin's keys.
  __threadfence();
  __syncthreads();
  if (t == 0) last = atomicAdd(&tickets[r], 1) == slices - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();

  const bool listed = in_bin <= CAP;            // else walk the row for the bin's keys
  const int space = listed ? in_bin : n;
  const int per = (space + THREADS - 1) / THREADS;
  const int i0 = min(space, t * per), i1 = min(space, i0 + per);  // this thread's, in order
  auto fetch = [&](int i, u32& kk, int& col) -> bool {
    if (listed) { kk = __ldcg(ckeys + i); col = __ldcg(ccols + i); return true; }
    kk = order_key(__ldcg(row + i)); col = i;
    return (kk >> TOP) == bin;
  };
  u32 prefix = bin;    // the k-th key's top bits so far: key >> shift
  int shift = TOP;
  int want = need;     // keys still wanted from those matching the prefix
  int count = in_bin;  // keys matching it
  while (count != want && shift > 0) {
    const int next = shift == TOP ? 10 : 0;
    for (int i = t; i < BINS; i += THREADS) h[i] = 0;
    __syncthreads();
    for (int i = i0; i < i1; ++i) {
      u32 kk; int col;
      if (fetch(i, kk, col) && (kk >> shift) == prefix)
        atomicAdd(&h[(kk >> next) & ((1u << (shift - next)) - 1)], 1);
    }
    __syncthreads();
    find_bin(h, want, sums32, sel);
    prefix = (prefix << (shift - next)) | (u32)sel[0];
    shift = next;
    want -= sel[1];
    count = sel[2];
  }
  // The bin's keys above the prefix, then the first `want` equal to it.
  u32 a = 0, e = 0;
  for (int i = i0; i < i1; ++i) {
    u32 kk; int col;
    if (!fetch(i, kk, col)) continue;
    a += (kk >> shift) > prefix;
    e += (kk >> shift) == prefix;
  }
  u64 unused;
  const u64 f = scan_threads<u64>((u64)a | (u64)e << 32, sums64, unused);
  int sa = above + (int)(u32)f;
  int se = (int)(f >> 32);
  const int ties_at = above + (need - want);
  for (int i = i0; i < i1; ++i) {
    u32 kk; int col;
    if (!fetch(i, kk, col)) continue;
    const u32 p = kk >> shift;
    if (p > prefix) orow[sa++] = col;
    else if (p == prefix) { if (se < want) orow[ties_at + se] = col; ++se; }
  }
}
