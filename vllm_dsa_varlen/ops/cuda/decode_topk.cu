// The indexer's decode top-k: per row r, the column indices of the k largest
// of logits[r, 0 : len[r]] (fp32), written to out[r, 0 : k] in no particular
// order; a row with len <= k gets 0 .. len - 1 and then -1.  Ties at the k-th
// value are broken arbitrarily (any k of the tied columns).  Loaded by
// vllm_dsa_varlen/ops/cuda_topk.py (NVRTC, sm_90a), which checks the inputs;
// ops/reference.py (topk_ref) defines the result.
//
// One CTA of THREADS threads per row, an exact radix select on the logits'
// order-preserving 32-bit keys (negative floats bit-flipped, positive ones
// with the sign bit set: unsigned order = float order), most significant
// digit first:
//   1. the row is read once from global memory (16-byte loads where the row
//      start is aligned), its keys staged in shared memory when it has at
//      most `stage` columns (the launcher sizes the stage from the logits'
//      width, a shape fact: graph safe), and a histogram of the top 11
//      bits made with shared-memory atomics;
//   2. a block-wide suffix sum over the bins finds the bin that holds the
//      k-th largest key: `above` keys lie in higher bins; if the bin holds
//      exactly the `k - above` keys still needed, the threshold is found;
//      else the next digit is histogrammed over the keys in that bin only
//      (staged keys, or the row read again), down to the full key;
//   3. one pass writes the selected columns: every key whose prefix is above
//      the threshold's, and the first `k - above` keys equal to it, to slots
//      given out per warp (two ballots and an atomic per key and kind).
// Every loop runs the same trip count in every thread (a function of the
// row's length), so the warp-wide ballots see full warps.  Nothing leaves the
// GPU; rows are independent, the grid is the row count.

typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#ifndef THREADS
#define THREADS 1024              // 512: two CTAs per SM where the stage allows (short rows)
#endif
#define WARPS (THREADS / 32)
#define BPT (BINS / THREADS)      // histogram bins per thread in the bin search
#define BINS 2048                 // 11-bit digits: 11 + 11 + 10 = 32
#define FULL 0xffffffffu
#define CAND 4096                 // candidate slots after the stage (the launcher's CAND)
#define BARS 16                   // TMA=1: one mbarrier per CHUNK columns of a staged row
#define CHUNK 4096                //   (the launcher's BARS, CHUNK)

#ifndef COMPACT
#define COMPACT 0                 // 1: a staged row's first-digit bin compacted, then narrowed alone
#endif                            //    (H200: 0.92-0.98x from B16 up, 1.03-1.10x at B128 L8K, B1);
                                  // 2: the same, slots from a count pass and a block scan
#ifndef BATCH
#define BATCH 1                   // pass 0: trips whose loads are issued together
#endif
#ifndef TMA
#define TMA 0                     // 1: a staged row starting on 16 bytes arrives by bulk copies,
#endif                            //    one per trip, all issued at once (pass 0 reads shared memory)
// Anatomy builds (timing only; they do not meet the contract): STOP=0 returns
// after reading the row's length, STOP=1 after pass 0 and its bin search,
// STOP=2 after the narrowing passes; NO_HIST=1 leaves pass 0's histogram out.
#ifndef STOP
#define STOP 3
#endif
#ifndef NO_HIST
#define NO_HIST 0
#endif


__device__ __forceinline__ u32 order_key(float x) {
  u32 b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The pass's digit: shift and width of digit p (0, 1, 2) of a 32-bit key.
__device__ __forceinline__ int digit_shift(int p) { return p == 0 ? 21 : p == 1 ? 10 : 0; }

// TMA=1's bulk copies into shared memory, each completing on an mbarrier.
__device__ __forceinline__ u32 smem_u32(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(u64* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait0(u64* bar) {   // the barrier's first phase
  asm volatile("{\n.reg .pred ready;\nTOPK_WAIT:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], 0;\n"
               "@!ready bra TOPK_WAIT;\n}\n" :: "r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, u32 bytes, u64* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(smem_u32(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
               "[%0], [%1], %2, [%3];"
               :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

// Four consecutive keys from column i (i % 4 == 0) of the row: `valid` of
// them in range (0..4).
struct Keys4 { u32 k[4]; };

__device__ __forceinline__ Keys4 load4_global(const float* __restrict__ row, int i, int n,
                                              bool aligned) {
  Keys4 r;
  if (aligned && i + 3 < n) {
    float4 v = __ldg(reinterpret_cast<const float4*>(row + i));
    r.k[0] = order_key(v.x); r.k[1] = order_key(v.y);
    r.k[2] = order_key(v.z); r.k[3] = order_key(v.w);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) r.k[j] = i + j < n ? order_key(__ldg(row + i + j)) : 0u;
  }
  return r;
}

__device__ __forceinline__ Keys4 load4_staged(const u32* __restrict__ keys, int i) {
  uint4 v = *reinterpret_cast<const uint4*>(keys + i);
  Keys4 r;
  r.k[0] = v.x; r.k[1] = v.y; r.k[2] = v.z; r.k[3] = v.w;
  return r;
}

// Add one to bin `bin` of `h` for each lane with `valid` (shared-memory
// atomics; aggregating equal bins per warp with __match_any_sync measured
// 1.5-3x slower on the H200).
__device__ __forceinline__ void hist_add(int* __restrict__ h, u32 bin, bool valid) {
  if (valid) atomicAdd(&h[bin], 1);
}

// Block-wide exclusive prefix sum of `v` over the threads in index order
// (all threads call it; `warp_sums`: WARPS words, free until the next
// barrier).  Unsigned: packed counts (low | high << 16) add without overflow.
__device__ __forceinline__ u32 block_exclusive_scan(u32 v, int* __restrict__ warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u32* sums = reinterpret_cast<u32*>(warp_sums);
  u32 incl = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    u32 u = __shfl_up_sync(FULL, incl, d);
    if (lane >= d) incl += u;
  }
  if (lane == 31) sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    u32 w = lane < WARPS ? sums[lane] : 0u;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      u32 u = __shfl_up_sync(FULL, w, d);
      if (lane >= d) w += u;
    }
    if (lane < WARPS) sums[lane] = w;
  }
  __syncthreads();
  return (warp ? sums[warp - 1] : 0u) + incl - v;
}

// Block-wide: the bin of `hist` (BINS counters) holding the `need`-th
// largest counted key; writes (bin, keys in higher bins, keys in the bin) to
// sel[0..2].  Thread t owns BPT bins from BINS-1-BPT*t down.
__device__ void find_bin(const int* __restrict__ hist, int need, int* __restrict__ warp_sums,
                         int* __restrict__ sel) {
  const int top = BINS - 1 - BPT * (int)threadIdx.x;     // this thread's bins: top, top - 1, ...
  int h[BPT], sum = 0;
#pragma unroll
  for (int j = 0; j < BPT; ++j) { h[j] = hist[top - j]; sum += h[j]; }
  int before = (int)block_exclusive_scan((u32)sum, warp_sums);
#pragma unroll
  for (int j = 0; j < BPT; ++j) {
    if (before < need && before + h[j] >= need) { sel[0] = top - j; sel[1] = before; sel[2] = h[j]; }
    before += h[j];
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(THREADS, 1024 / THREADS)
decode_topk(const float* __restrict__ logits, i64 row_stride, const int* __restrict__ lens,
            int width, int k, int* __restrict__ out, i64 out_stride, int stage) {
  extern __shared__ __align__(16) unsigned char smem[];
  int* hist = reinterpret_cast<int*>(smem);               // BINS
  int* warp_sums = hist + BINS;                           // WARPS
  int* sel = warp_sums + WARPS;                           // bin, above, in bin, slot counters
  u64* bars = reinterpret_cast<u64*>(sel + 16);           // BARS (TMA=1)
  u32* keys = reinterpret_cast<u32*>(bars + BARS);        // stage (16-byte aligned)

  const int r = blockIdx.x, t = threadIdx.x, lane = t & 31;
  int n = lens[r];
  n = n < 0 ? 0 : n > width ? width : n;
  int* __restrict__ orow = out + (i64)r * out_stride;
#if STOP == 0
  if (t == 0) orow[0] = n;
  return;
#endif
  if (n <= k) {
    for (int i = t; i < k; i += THREADS) orow[i] = i < n ? i : -1;
    return;
  }
  const float* __restrict__ row = logits + (i64)r * row_stride;
  const bool aligned = (reinterpret_cast<unsigned long long>(row) & 15) == 0;
  const bool staged = n <= stage;
  const int span = 4 * THREADS;                            // columns per loop trip
  const int trips = (n + span - 1) / span;

  // Pass 0: read the row, stage its keys, histogram the top digit.
#if TMA
  const bool bulk = staged && aligned;   // then n / CHUNK < BARS (the launcher's stage)
  if (bulk && t == 0) {
    for (int c = 0; c * CHUNK < n; ++c) mbar_init(&bars[c]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
#endif
  for (int i = t; i < BINS; i += THREADS) hist[i] = 0;
  __syncthreads();
#if TMA
  if (bulk) {
    const int n4 = n & ~3;               // the columns the copies bring; the rest from global
    if (t == 0)
      for (int c = 0; c * CHUNK < n4; ++c) {
        const int lo = c * CHUNK, hi = min(lo + CHUNK, n4);
        bulk_load(keys + lo, row + lo, 4u * (hi - lo), &bars[c]);
      }
    for (int it = 0; it < trips; ++it) {
      const int i = it * span + 4 * t;
      if (it * span < n4) mbar_wait0(&bars[it * span / CHUNK]);
      Keys4 v = {{0u, 0u, 0u, 0u}};
      if (i < n4) {
        const float4 f = *reinterpret_cast<const float4*>(keys + i);
        v.k[0] = order_key(f.x); v.k[1] = order_key(f.y);
        v.k[2] = order_key(f.z); v.k[3] = order_key(f.w);
        *reinterpret_cast<uint4*>(keys + i) = make_uint4(v.k[0], v.k[1], v.k[2], v.k[3]);
      } else if (i < n) {
        v = load4_global(row, i, n, false);
        *reinterpret_cast<uint4*>(keys + i) = make_uint4(v.k[0], v.k[1], v.k[2], v.k[3]);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) hist_add(hist, v.k[j] >> 21, !NO_HIST && i + j < n);
    }
  } else
#endif
#if BATCH > 1
  for (int it0 = 0; it0 < trips; it0 += BATCH) {
    Keys4 v[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int i = (it0 + b) * span + 4 * t;
      v[b] = Keys4{{0u, 0u, 0u, 0u}};
      if (i < n) v[b] = load4_global(row, i, n, aligned);
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int i = (it0 + b) * span + 4 * t;
      if (staged && i < n)
        *reinterpret_cast<uint4*>(keys + i) = make_uint4(v[b].k[0], v[b].k[1], v[b].k[2], v[b].k[3]);
#pragma unroll
      for (int j = 0; j < 4; ++j) hist_add(hist, v[b].k[j] >> 21, !NO_HIST && i + j < n);
    }
  }
#else
  for (int it = 0; it < trips; ++it) {
    const int i = it * span + 4 * t;
    Keys4 v = {{0u, 0u, 0u, 0u}};
    if (i < n) {
      v = load4_global(row, i, n, aligned);
      if (staged) *reinterpret_cast<uint4*>(keys + i) = make_uint4(v.k[0], v.k[1], v.k[2], v.k[3]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) hist_add(hist, v.k[j] >> 21, !NO_HIST && i + j < n);
  }
#endif
  __syncthreads();
  find_bin(hist, k, warp_sums, sel);
#if STOP == 1
  if (t == 0) orow[0] = sel[0];
  return;
#endif

#if COMPACT
#if COMPACT == 2
  // The first digit's bin, if it holds at most CAND keys of a staged row (or
  // exactly the keys still needed): each thread counts its keys above the bin
  // and in it, a block scan gives every thread its own output and list slots,
  // and one pass writes the keys above the bin and lists the bin's columns
  // (after the stage; straight to the output when the whole bin is taken);
  // the next digits and the select then read that list only.
  if (staged && (sel[2] <= CAND || sel[2] == k - sel[1])) {
    const u32 b0 = (u32)sel[0];
    const int in0 = sel[2], above0 = sel[1];
    const bool direct = in0 == k - above0;
    u32* cand = keys + stage;
    const u32 lt = (1u << lane) - 1;
    u32 counts = 0;                  // keys above the bin | keys in it << 16 (n < 2^16)
    for (int it = 0; it < trips; ++it) {
      const int i = it * span + 4 * t;
      Keys4 v = {{0u, 0u, 0u, 0u}};
      if (i < n) v = load4_staged(keys, i);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u32 d = v.k[j] >> 21;
        counts += i + j < n ? (d > b0 ? 1u : d == b0 ? 1u << 16 : 0u) : 0u;
      }
    }
    const u32 first = block_exclusive_scan(counts, warp_sums);
    int slot_hi = (int)(first & 0xffff), slot_eq = (int)(first >> 16);
    int* eq_out = direct ? orow + above0 : reinterpret_cast<int*>(cand);
    for (int it = 0; it < trips; ++it) {
      const int i = it * span + 4 * t;
      Keys4 v = {{0u, 0u, 0u, 0u}};
      if (i < n) v = load4_staged(keys, i);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u32 d = v.k[j] >> 21;
        if (i + j < n && d > b0) orow[slot_hi++] = i + j;
        else if (i + j < n && d == b0) eq_out[slot_eq++] = i + j;
      }
    }
    if (direct) return;
    if (t == 0) { sel[3] = above0; sel[4] = 0; }
    __syncthreads();
#else
  // The first digit's bin, if it holds at most CAND keys of a staged row:
  // one pass writes the keys above it and lists its keys' columns (after the
  // stage); the next digits and the select then read that list only.
  if (staged && sel[2] != k - sel[1] && sel[2] <= CAND) {
    const u32 b0 = (u32)sel[0];
    const int in0 = sel[2];
    u32* cand = keys + stage;
    const u32 lt = (1u << lane) - 1;
    if (t == 0) { sel[3] = 0; sel[4] = 0; sel[5] = 0; }
    __syncthreads();
    for (int it = 0; it < trips; ++it) {
      const int i = it * span + 4 * t;
      Keys4 v = {{0u, 0u, 0u, 0u}};
      if (i < n) v = load4_staged(keys, i);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool in = i + j < n;
        const u32 d = v.k[j] >> 21;
        const bool hi = in && d > b0, eq = in && d == b0;
        const u32 mhi = __ballot_sync(FULL, hi), meq = __ballot_sync(FULL, eq);
        int base_hi = 0, base_c = 0;
        if (lane == 0) {
          if (mhi) base_hi = atomicAdd(&sel[3], __popc(mhi));
          if (meq) base_c = atomicAdd(&sel[5], __popc(meq));
        }
        base_hi = __shfl_sync(FULL, base_hi, 0);
        base_c = __shfl_sync(FULL, base_c, 0);
        if (hi) orow[base_hi + __popc(mhi & lt)] = i + j;
        if (eq) cand[base_c + __popc(meq & lt)] = i + j;
      }
    }
    __syncthreads();
#endif
    u32 prefix = b0;
    int shift = 21, above = sel[1], in_bin = in0;
    const int ctrips = (in0 + THREADS - 1) / THREADS;
    for (int p = 1; p < 3 && in_bin != k - above; ++p) {
      const int next = digit_shift(p);
      for (int i = t; i < BINS; i += THREADS) hist[i] = 0;
      __syncthreads();
      for (int it = 0; it < ctrips; ++it) {
        const int c = it * THREADS + t;
        const u32 key = c < in0 ? keys[cand[c]] : 0u;
        hist_add(hist, (key >> next) & ((1u << (shift - next)) - 1),
                 c < in0 && (key >> shift) == prefix);
      }
      __syncthreads();
      find_bin(hist, k - above, warp_sums, sel);
      prefix = (prefix << (shift - next)) | (u32)sel[0];
      shift = next;
      above += sel[1];
      in_bin = sel[2];
    }
    // Keys above the threshold take slots after the first pass's (sel[3]
    // counts on), equal ones the first k - above slots from `above`.
    const int ties = k - above;
    for (int it = 0; it < ctrips; ++it) {
      const int c = it * THREADS + t;
      const int col = c < in0 ? (int)cand[c] : 0;
      const u32 pre = c < in0 ? keys[col] >> shift : 0u;
      const bool hi = c < in0 && pre > prefix, eq = c < in0 && pre == prefix;
      const u32 mhi = __ballot_sync(FULL, hi), meq = __ballot_sync(FULL, eq);
      int base_hi = 0, base_eq = 0;
      if (lane == 0) {
        if (mhi) base_hi = atomicAdd(&sel[3], __popc(mhi));
        if (meq) base_eq = atomicAdd(&sel[4], __popc(meq));
      }
      base_hi = __shfl_sync(FULL, base_hi, 0);
      base_eq = __shfl_sync(FULL, base_eq, 0);
      if (hi) orow[base_hi + __popc(mhi & lt)] = col;
      if (eq) {
        const int slot = base_eq + __popc(meq & lt);
        if (slot < ties) orow[above + slot] = col;
      }
    }
    return;
  }
#endif

  // Narrow the threshold digit by digit until its bin holds exactly the keys
  // still needed or the whole key is fixed.
  u32 prefix = (u32)sel[0];        // the threshold key's top bits so far
  int shift = 21;                  // prefix = key >> shift
  int above = sel[1];              // keys with a larger prefix
  int in_bin = sel[2];
  for (int p = 1; p < 3 && in_bin != k - above; ++p) {
    const int next = digit_shift(p);
    for (int i = t; i < BINS; i += THREADS) hist[i] = 0;
    __syncthreads();
    for (int it = 0; it < trips; ++it) {
      const int i = it * span + 4 * t;
      Keys4 v = {{0u, 0u, 0u, 0u}};
      if (i < n) v = staged ? load4_staged(keys, i) : load4_global(row, i, n, aligned);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        hist_add(hist, (v.k[j] >> next) & ((1u << (shift - next)) - 1),
                 i + j < n && (v.k[j] >> shift) == prefix);
    }
    __syncthreads();
    find_bin(hist, k - above, warp_sums, sel);
    prefix = (prefix << (shift - next)) | (u32)sel[0];
    shift = next;
    above += sel[1];
    in_bin = sel[2];
  }
#if STOP == 2
  if (t == 0) orow[0] = (int)prefix;
  return;
#endif

  // Select: prefix above the threshold's, or equal and among the first
  // k - above such keys.  Slots: [0, above) for the former, [above, k) for
  // the latter; per key two ballots, lane 0 takes the warp's slots (one
  // atomic each; a warp scan of the threads' counts with one 64-bit atomic
  // per trip measured 3-6 % slower).
  const int ties = k - above;
  if (t == 0) { sel[3] = 0; sel[4] = 0; }
  __syncthreads();
  const u32 lt = (1u << lane) - 1;
  for (int it = 0; it < trips; ++it) {
    const int i = it * span + 4 * t;
    Keys4 v;
    if (i < n) v = staged ? load4_staged(keys, i) : load4_global(row, i, n, aligned);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool in = i + j < n;
      const u32 pre = in ? v.k[j] >> shift : 0u;
      const bool hi = in && pre > prefix, eq = in && pre == prefix;
      const u32 mhi = __ballot_sync(FULL, hi), meq = __ballot_sync(FULL, eq);
      int base_hi = 0, base_eq = 0;
      if (lane == 0) {
        if (mhi) base_hi = atomicAdd(&sel[3], __popc(mhi));
        if (meq) base_eq = atomicAdd(&sel[4], __popc(meq));
      }
      base_hi = __shfl_sync(FULL, base_hi, 0);
      base_eq = __shfl_sync(FULL, base_eq, 0);
      if (hi) orow[base_hi + __popc(mhi & lt)] = i + j;
      if (eq) {
        const int slot = base_eq + __popc(meq & lt);
        if (slot < ties) orow[above + slot] = i + j;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// decode_topk_split: the same contract, each row split over a cluster of
// SPLIT CTAs (one CTA per row when SPLIT is 1).  CTA q of row r's cluster
// takes columns [q*S, (q+1)*S) of the row (S = the row's length / SPLIT,
// rounded up to 4) and stages their keys in shared memory when S <= `stage`
// (by bulk copies where the slice starts on 16 bytes; a longer slice is read
// from global memory in every pass: right for any length, slower).  Then:
//   1. each CTA histograms its slice's top digit; every CTA sums the
//      cluster's histograms (distributed shared memory) and finds the same
//      threshold bin;
//   2. while that bin holds more than CAND keys (and not exactly the keys
//      still needed), the next digit is histogrammed the same way;
//   3. each thread counts its keys above the threshold prefix and equal to
//      it; a block scan and the cluster's totals give every thread its own
//      slots: keys above go to the output, equal ones either to the output
//      (the bin is taken whole, or the full key is fixed: the first k - above)
//      or, with their keys, to a candidate list in CTA 0;
//   4. CTA 0 narrows the candidates alone (at most CAND) and writes the rest.
// No atomics but the histogram adds; every cluster barrier is reached by
// every thread of every CTA of the cluster (the loop counts are functions of
// cluster-wide sums, identical in every CTA).
#ifndef SPLIT
#define SPLIT 1
#endif

#if SPLIT > 1
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {   // a CTA barrier too
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
template <class T>
__device__ __forceinline__ T* in_cta(T* p, u32 rank) {  // p's place in CTA `rank`'s shared memory
  u64 got;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(got) : "l"(p), "r"(rank));
  return reinterpret_cast<T*>(got);
}
#else
__device__ __forceinline__ u32 cluster_rank() { return 0; }
__device__ __forceinline__ void cluster_sync() { __syncthreads(); }
template <class T>
__device__ __forceinline__ T* in_cta(T* p, u32) { return p; }
#endif

// The cluster's histogram (the sum of every CTA's `hist`) over this thread's
// find_bin bins, then the bin search on it.  Call after a cluster barrier
// that follows the last add; the caller's next cluster barrier must come
// before any `hist` is changed again.
__device__ __forceinline__ void cluster_find_bin(const int* __restrict__ hist, int need,
                                                 int* __restrict__ warp_sums,
                                                 int* __restrict__ sel) {
  const int top = BINS - 1 - BPT * (int)threadIdx.x;
  int h[BPT], sum = 0;
#pragma unroll
  for (int j = 0; j < BPT; ++j) h[j] = 0;
#pragma unroll
  for (int c = 0; c < SPLIT; ++c) {
    const int* hc = in_cta(hist, (u32)c);
#pragma unroll
    for (int j = 0; j < BPT; ++j) h[j] += hc[top - j];
  }
#pragma unroll
  for (int j = 0; j < BPT; ++j) sum += h[j];
  int before = (int)block_exclusive_scan((u32)sum, warp_sums);
#pragma unroll
  for (int j = 0; j < BPT; ++j) {
    if (before < need && before + h[j] >= need) { sel[0] = top - j; sel[1] = before; sel[2] = h[j]; }
    before += h[j];
  }
  __syncthreads();
}

#ifndef MINB
#define MINB 1                    // CTAs per SM the registers must allow (2: 32 per thread at 1024)
#endif

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
#if SPLIT > 1
__cluster_dims__(SPLIT, 1, 1)
#endif
decode_topk_split(const float* __restrict__ logits, i64 row_stride, const int* __restrict__ lens,
                  int width, int k, int* __restrict__ out, i64 out_stride, int stage) {
  extern __shared__ __align__(16) unsigned char smem[];
  int* hist = reinterpret_cast<int*>(smem);               // BINS
  int* warp_sums = hist + BINS;                           // WARPS
  int* sel = warp_sums + WARPS;                           // bin, above, in bin; [8]: slice totals
  u64* bars = reinterpret_cast<u64*>(sel + 16);           // BARS
  u32* keys = reinterpret_cast<u32*>(bars + BARS);        // stage (16-byte aligned)
  u32* cand_keys = keys + stage;                          // CAND (CTA 0's are the list)
  int* cand_cols = reinterpret_cast<int*>(cand_keys + CAND);  // CAND

  const int r = blockIdx.x / SPLIT, t = threadIdx.x;
  const u32 q = cluster_rank();
  int n = lens[r];
  n = n < 0 ? 0 : n > width ? width : n;
  int* __restrict__ orow = out + (i64)r * out_stride;
  if (n <= k) {                                           // the same in every CTA of the cluster
    if (q == 0)
      for (int i = t; i < k; i += THREADS) orow[i] = i < n ? i : -1;
    return;
  }
  const int S = ((n + SPLIT - 1) / SPLIT + 3) & ~3;
  const int lo = (int)q * S;
  const int m = max(0, min(n, lo + S) - lo);              // this CTA's columns
  const bool staged = S <= stage;                         // else every pass reads global memory
  const float* __restrict__ row = logits + (i64)r * row_stride + lo;
  const bool aligned = (reinterpret_cast<unsigned long long>(row) & 15) == 0;
  const int span = 4 * THREADS;
  const int trips = (m + span - 1) / span;
  const int m4 = aligned && staged ? (m & ~3) : 0;        // columns the bulk copies bring

  // Pass 0: stage the slice, histogram its top digit.
  if (t == 0 && m4 > 0) {
    for (int c = 0; c * CHUNK < m4; ++c) mbar_init(&bars[c]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int i = t; i < BINS; i += THREADS) hist[i] = 0;
  __syncthreads();
  if (t == 0)
    for (int c = 0; c * CHUNK < m4; ++c) {
      const int a = c * CHUNK, b = min(a + CHUNK, m4);
      bulk_load(keys + a, row + a, 4u * (b - a), &bars[c]);
    }
  for (int it = 0; it < trips; ++it) {
    const int i = it * span + 4 * t;
    if (it * span < m4) mbar_wait0(&bars[it * span / CHUNK]);
    Keys4 v = {{0u, 0u, 0u, 0u}};
    if (i < m4) {
      const float4 f = *reinterpret_cast<const float4*>(keys + i);
      v.k[0] = order_key(f.x); v.k[1] = order_key(f.y);
      v.k[2] = order_key(f.z); v.k[3] = order_key(f.w);
    } else if (i < m) {
      v = load4_global(row, i, m, aligned);
    }
    if (staged && i < m)
      *reinterpret_cast<uint4*>(keys + i) = make_uint4(v.k[0], v.k[1], v.k[2], v.k[3]);
#pragma unroll
    for (int j = 0; j < 4; ++j) hist_add(hist, v.k[j] >> 21, i + j < m);
  }
  cluster_sync();
  cluster_find_bin(hist, k, warp_sums, sel);
  u32 prefix = (u32)sel[0];        // the threshold key's top bits so far
  int shift = 21;                  // prefix = key >> shift
  int above = sel[1];              // keys with a larger prefix, cluster-wide
  int in_bin = sel[2];

  // Narrow over the slices while the bin is too wide to list.
  for (int p = 1; p < 3 && in_bin != k - above && in_bin > CAND; ++p) {
    const int next = digit_shift(p);
    cluster_sync();                // every CTA has read every `hist`
    for (int i = t; i < BINS; i += THREADS) hist[i] = 0;
    __syncthreads();
    for (int it = 0; it < trips; ++it) {
      const int i = it * span + 4 * t;
      Keys4 v = {{0u, 0u, 0u, 0u}};
      if (i < m) v = staged ? load4_staged(keys, i) : load4_global(row, i, m, aligned);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        hist_add(hist, (v.k[j] >> next) & ((1u << (shift - next)) - 1),
                 i + j < m && (v.k[j] >> shift) == prefix);
    }
    cluster_sync();
    cluster_find_bin(hist, k - above, warp_sums, sel);
    prefix = (prefix << (shift - next)) | (u32)sel[0];
    shift = next;
    above += sel[1];
    in_bin = sel[2];
  }

  // Slots: count, block scan, the cluster's totals before this CTA.
  const int need = k - above;
  const bool take = in_bin == need || shift == 0;  // else in_bin <= CAND: listed in CTA 0
  u32 counts = 0;                                  // above | equal << 16 (a slice < 2^16 columns)
  for (int it = 0; it < trips; ++it) {
    const int i = it * span + 4 * t;
    Keys4 v = {{0u, 0u, 0u, 0u}};
    if (i < m) v = staged ? load4_staged(keys, i) : load4_global(row, i, m, aligned);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const u32 pre = v.k[j] >> shift;
      counts += i + j < m ? (pre > prefix ? 1u : pre == prefix ? 1u << 16 : 0u) : 0u;
    }
  }
  const u32 first = block_exclusive_scan(counts, warp_sums);
  if (t == THREADS - 1) sel[8] = (int)(first + counts);   // this slice's totals
  cluster_sync();
  int slot_hi = (int)(first & 0xffff), slot_eq = (int)(first >> 16);
  for (u32 c = 0; c < q; ++c) {
    const u32 v = (u32)*in_cta(&sel[8], c);
    slot_hi += (int)(v & 0xffff);
    slot_eq += (int)(v >> 16);
  }
  u32* list_keys = in_cta(cand_keys, 0);
  int* list_cols = in_cta(cand_cols, 0);
  for (int it = 0; it < trips; ++it) {
    const int i = it * span + 4 * t;
    Keys4 v = {{0u, 0u, 0u, 0u}};
    if (i < m) v = staged ? load4_staged(keys, i) : load4_global(row, i, m, aligned);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const u32 pre = v.k[j] >> shift;
      if (i + j >= m) continue;
      if (pre > prefix) {
        orow[slot_hi++] = lo + i + j;
      } else if (pre == prefix) {
        if (!take) { list_keys[slot_eq] = v.k[j]; list_cols[slot_eq] = lo + i + j; }
        else if (slot_eq < need) orow[above + slot_eq] = lo + i + j;
        ++slot_eq;
      }
    }
  }
  cluster_sync();                  // the list is whole; no CTA reads another's memory after this
  if (take || q != 0) return;

  // CTA 0: narrow the listed keys (in_bin <= CAND of them) and write the rest.
  const int listed = in_bin, base = above;
  const int ctrips = (listed + THREADS - 1) / THREADS;
  while (in_bin != k - above && shift > 0) {
    const int next = shift == 21 ? 10 : 0;
    for (int i = t; i < BINS; i += THREADS) hist[i] = 0;
    __syncthreads();
    for (int it = 0; it < ctrips; ++it) {
      const int c = it * THREADS + t;
      const u32 key = c < listed ? cand_keys[c] : 0u;
      hist_add(hist, (key >> next) & ((1u << (shift - next)) - 1),
               c < listed && (key >> shift) == prefix);
    }
    __syncthreads();
    find_bin(hist, k - above, warp_sums, sel);
    prefix = (prefix << (shift - next)) | (u32)sel[0];
    shift = next;
    above += sel[1];
    in_bin = sel[2];
  }
  const int ties = k - above;
  counts = 0;
  for (int it = 0; it < ctrips; ++it) {
    const int c = it * THREADS + t;
    const u32 pre = c < listed ? cand_keys[c] >> shift : 0u;
    counts += c < listed ? (pre > prefix ? 1u : pre == prefix ? 1u << 16 : 0u) : 0u;
  }
  const u32 cfirst = block_exclusive_scan(counts, warp_sums);
  slot_hi = base + (int)(cfirst & 0xffff);
  slot_eq = (int)(cfirst >> 16);
  for (int it = 0; it < ctrips; ++it) {
    const int c = it * THREADS + t;
    if (c >= listed) continue;
    const u32 pre = cand_keys[c] >> shift;
    if (pre > prefix) orow[slot_hi++] = cand_cols[c];
    else if (pre == prefix && slot_eq++ < ties) orow[above + slot_eq - 1] = cand_cols[c];
  }
}
