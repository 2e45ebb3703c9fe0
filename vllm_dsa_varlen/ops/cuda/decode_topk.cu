// The indexer's decode top-k: per row r, the column indices of the k largest
// of logits[r, 0 : len[r]] (fp32), written to out[r, 0 : k] in no particular
// order; a row with len <= k gets 0 .. len - 1 and then -1.  Ties at the k-th
// value are broken arbitrarily (any k of the tied columns).  Loaded by
// vllm_dsa_varlen/ops/cuda_topk.py (NVRTC, sm_90a), which checks the inputs
// and picks the build (SPLIT, MINB) and the stage; ops/reference.py
// (topk_ref) defines the result.
//
// An exact radix select on the logits' order-preserving 32-bit keys
// (negative floats bit-flipped, positive ones with the sign bit set: unsigned
// order = float order), digits of 11, 11 and 10 bits, each row over a cluster
// of SPLIT CTAs (one CTA per row when SPLIT is 1).  CTA q of row r's cluster
// takes columns [q*S, (q+1)*S) of the row (S = the row's length / SPLIT,
// rounded up to 4) and stages their keys in shared memory when S <= `stage`
// (by bulk copies where the slice starts on 16 bytes; a longer slice is read
// from global memory in every pass: right for any length, slower).  Then:
//   1. each CTA histograms its slice's top digit (shared-memory atomics);
//      every CTA sums the cluster's histograms (distributed shared memory)
//      and finds the same bin holding the k-th largest key, `above` keys
//      lying in higher bins;
//   2. while that bin holds more than CAND keys (LIST=0: any number) and
//      not exactly the k - above keys still needed, the next digit is
//      histogrammed the same way over the keys in the bin;
//   3. each thread counts its keys above the threshold prefix and equal to
//      it; a block scan and the cluster's totals give every thread its own
//      slots: keys above go to the output, equal ones either to the output
//      (the bin taken whole, or the full key fixed: the first k - above) or,
//      with their keys, to a candidate list in CTA 0;
//   4. CTA 0 narrows the candidates alone (at most CAND) and writes the rest
//      (LIST=1 only: with LIST=0 step 2 has fixed the key).
// SAMPLE=1 (one CTA a row, listed): a staged row of at least
// SAMPLE_MIN_TRIPS trips histograms in pass 0 only a rotating one in
// SAMPLE_STRIDE of each trip's warps (128 columns of every 1024, spread over
// the whole row), takes a 22-bit threshold below the k-th key from that sample, and
// where k to CAND keys pass it lists them and selects among them (step 4
// from the top digit); else the whole row's histogram and steps 1-4.
// No atomics but the histogram adds; every cluster barrier is reached by
// every thread of every CTA of the cluster (the loop counts are functions of
// cluster-wide sums, identical in every CTA).  Rows are independent; the
// grid is rows x SPLIT.  Nothing leaves the GPU.
// A function that reaches a barrier takes no non-const __restrict__ pointer:
// through one the compiler may keep a word across __syncthreads() that
// another thread wrote (a stale read, and threads taking different barriers).

typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#ifndef THREADS
#define THREADS 1024              // per CTA: 512 or 1024
#endif
#define WARPS (THREADS / 32)
#define BINS 2048                 // 11-bit digits: 11 + 11 + 10 = 32
#define BPT (BINS / THREADS)      // histogram bins per thread in the bin search
#define FULL 0xffffffffu
#define CAND 4096                 // listed candidates after the stage (the launcher's CAND)
#define BARS 16                   // one mbarrier per CHUNK columns of a staged slice
#define CHUNK 4096                //   (the launcher's BARS, CHUNK)
#ifndef SPLIT
#define SPLIT 1                   // CTAs per row (a cluster): 1, 2, 4
#endif
#ifndef MINB
#define MINB 1                    // CTAs per SM the registers must allow (2: 32 per thread)
#endif
#ifndef LIST
#define LIST 1                    // 1: list the threshold bin's keys (<= CAND) in CTA 0 and
#endif                            //    narrow them there; 0: narrow over the slices to the end
#ifndef SAMPLE
#define SAMPLE 0                  // 1: a staged row of >= SAMPLE_MIN_TRIPS trips first histograms a
#endif                            //    sample (in_sample) for a threshold below the
#define SAMPLE_STRIDE 8           //    k-th key, lists the keys at or above it and selects among them;
#define SAMPLE_MIN_TRIPS 4        //    the plain path where fewer than k or more than CAND pass
// The builds cuda_topk.plan_builds names: SPLIT c (MINB 1, or 2 at one CTA a row), the
// sampled one (SPLIT 1, MINB 1), and one CTA a row without the list at 512 threads
// (MINB 4) or 1024 (MINB 2).
#if SAMPLE && !(LIST == 1 && SPLIT == 1 && THREADS == 1024 && MINB == 1)
#error "SAMPLE is a build of one CTA a row with the candidate list"
#endif
#if !((LIST == 1 && THREADS == 1024 && (MINB == 1 || (SPLIT == 1 && MINB == 2)) \
       && (SPLIT == 1 || SPLIT == 2 || SPLIT == 4)) \
      || (LIST == 0 && SPLIT == 1 && ((THREADS == 512 && MINB == 4) \
                                      || (THREADS == 1024 && MINB == 2))))
#error "not a build cuda_topk.plan_builds names"
#endif

__device__ __forceinline__ u32 order_key(float x) {
  u32 b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The pass's digit: shift and width of digit p (0, 1, 2) of a 32-bit key.
__device__ __forceinline__ int digit_shift(int p) { return p == 0 ? 21 : p == 1 ? 10 : 0; }

// Bulk copies into shared memory, each completing on an mbarrier.
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
// atomics; aggregating equal bins per warp with __match_any_sync was slower).
__device__ __forceinline__ void hist_add(int* __restrict__ h, u32 bin, bool valid) {
  if (valid) atomicAdd(&h[bin], 1);
}

// f(key, i, valid) for this thread's keys of a CTA's slice of m columns, four
// per trip (i: the column in the slice), from the stage or, where the slice
// is longer than it, from global memory: every pass after pass 0 walks it so.
template <class F>
__device__ __forceinline__ void each_key(const u32* __restrict__ keys,
                                         const float* __restrict__ row, int m, bool staged,
                                         bool aligned, F&& f) {
  const int span = 4 * THREADS, trips = (m + span - 1) / span;
  for (int it = 0; it < trips; ++it) {
    const int i = it * span + 4 * (int)threadIdx.x;
    Keys4 v = {{0u, 0u, 0u, 0u}};
    if (i < m) v = staged ? load4_staged(keys, i) : load4_global(row, i, m, aligned);
#pragma unroll
    for (int j = 0; j < 4; ++j) f(v.k[j], i + j, i + j < m);
  }
}

// Block-wide exclusive prefix sum of `v` over the threads in index order
// (all threads call it; `scratch`: WARPS words of T, free until the next
// barrier).  Unsigned, so packed counts (low | high << half the width) add
// without overflow.
template <class T>
__device__ __forceinline__ T block_exclusive_scan(T v, void* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T* sums = reinterpret_cast<T*>(scratch);
  T incl = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    T u = __shfl_up_sync(FULL, incl, d);
    if (lane >= d) incl += u;
  }
  if (lane == 31) sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    T w = lane < WARPS ? sums[lane] : T(0);
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      T u = __shfl_up_sync(FULL, w, d);
      if (lane >= d) w += u;
    }
    if (lane < WARPS) sums[lane] = w;
  }
  __syncthreads();
  return (warp ? sums[warp - 1] : T(0)) + incl - v;
}

// Clusters (SPLIT > 1): rank, barrier, a pointer into another CTA's shared memory.
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

// Block-wide: the bin holding the `need`-th largest key counted in the sum
// of CTAS CTAs' `hist` (CTAS > 1: this cluster's CTAs 0 .. CTAS-1, through
// distributed shared memory; call after a cluster barrier that follows the
// last add, and change no `hist` before the next cluster barrier); writes
// (bin, keys in higher bins, keys in the bin) to sel[0..2].  Thread t owns
// BPT bins from BINS-1-BPT*t down.
template <int CTAS>
__device__ void find_bin(const int* __restrict__ hist, int need, int* warp_sums, int* sel) {
  const int top = BINS - 1 - BPT * (int)threadIdx.x;
  int h[BPT], sum = 0;
#pragma unroll
  for (int j = 0; j < BPT; ++j) h[j] = 0;
#pragma unroll
  for (int c = 0; c < CTAS; ++c) {
    const int* hc = CTAS > 1 ? in_cta(hist, (u32)c) : hist;
#pragma unroll
    for (int j = 0; j < BPT; ++j) h[j] += hc[top - j];
  }
#pragma unroll
  for (int j = 0; j < BPT; ++j) sum += h[j];
  int before = (int)block_exclusive_scan<u32>((u32)sum, warp_sums);
#pragma unroll
  for (int j = 0; j < BPT; ++j) {
    if (before < need && before + h[j] >= need) { sel[0] = top - j; sel[1] = before; sel[2] = h[j]; }
    before += h[j];
  }
  __syncthreads();
}

#if LIST
// The top digits of a key above `shift` (0 .. 32: 32 keeps none).
__device__ __forceinline__ u32 key_top(u32 key, int shift) {
  return shift >= 32 ? 0u : key >> shift;
}

// The listed keys' part of the row's top k (CTA-wide; the list whole in this
// CTA's shared memory): `listed` keys, all with top bits above `shift` equal
// to `prefix` (shift 32: any key) and holding the k-th largest, `above` keys
// of the row being larger than all of them (already written).  Narrows the prefix digit by
// digit (11, 11, 10 bits from the top) until its keys are exactly the ones
// still needed or the key is whole, then writes the listed keys above it and
// the first of those equal to it after the `above` slots.
__device__ void narrow_list(const u32* __restrict__ cand_keys, const int* __restrict__ cand_cols,
                            int listed, u32 prefix, int shift, int above, int k,
                            int* orow, int* hist, int* warp_sums, int* sel) {
  const int t = threadIdx.x, base = above;
  const int ctrips = (listed + THREADS - 1) / THREADS;
  int in_bin = listed;                             // every listed key is under the prefix
  while (in_bin != k - above && shift > 0) {
    const int next = shift == 32 ? 21 : shift == 21 ? 10 : 0;
    for (int i = t; i < BINS; i += THREADS) hist[i] = 0;
    __syncthreads();
    for (int it = 0; it < ctrips; ++it) {
      const int c = it * THREADS + t;
      const u32 key = c < listed ? cand_keys[c] : 0u;
      hist_add(hist, (key >> next) & ((1u << (shift - next)) - 1),
               c < listed && key_top(key, shift) == prefix);
    }
    __syncthreads();
    find_bin<1>(hist, k - above, warp_sums, sel);
    prefix = (shift >= 32 ? 0u : prefix << (shift - next)) | (u32)sel[0];
    shift = next;
    above += sel[1];
    in_bin = sel[2];
  }
  const int ties = k - above;
  u32 ccounts = 0;                                 // above | equal << 16 (at most CAND listed)
  for (int it = 0; it < ctrips; ++it) {
    const int c = it * THREADS + t;
    const u32 pre = c < listed ? key_top(cand_keys[c], shift) : 0u;
    ccounts += c < listed ? (pre > prefix ? 1u : pre == prefix ? 1u << 16 : 0u) : 0u;
  }
  const u32 cfirst = block_exclusive_scan<u32>(ccounts, warp_sums);
  int slot_hi = base + (int)(cfirst & 0xffff);
  int slot_eq = (int)(cfirst >> 16);
  for (int it = 0; it < ctrips; ++it) {
    const int c = it * THREADS + t;
    if (c >= listed) continue;
    const u32 pre = key_top(cand_keys[c], shift);
    if (pre > prefix) orow[slot_hi++] = cand_cols[c];
    else if (pre == prefix && slot_eq++ < ties) orow[above + slot_eq - 1] = cand_cols[c];
  }
}
#endif

// Whether this thread's keys of trip `it` are in the sample: its warp is one
// in SAMPLE_STRIDE, rotating with the trip, so the sample spans the row
// (logits that drift with position still give a fair threshold).
__device__ __forceinline__ bool in_sample(int it) {
  return ((threadIdx.x >> 5) + it) % SAMPLE_STRIDE == 0;
}

#if SAMPLE
// A staged row's top k from a sample (SAMPLE builds; CTA-wide, after pass 0
// histogrammed the top digit of the sampled keys (in_sample) into
// `hist`): the sample's bin of its (expected rank of the k-th + a margin)-th
// key, refined by the next 11 bits over the sample, gives a 22-bit threshold
// below the row's k-th key unless the sample misled.  Where at least k and at
// most CAND keys pass it, they are listed and the top k selected among them
// (narrow_list); returns true.  Otherwise `hist` is left holding the whole
// row's top digits, as the plain path needs; returns false.
__device__ bool sampled_select(const u32* __restrict__ keys, const float* __restrict__ row, int m,
                               bool aligned, int k, int* orow, int* hist,
                               int* warp_sums, int* sel, u32* cand_keys, int* cand_cols) {
  const int t = threadIdx.x, span = 4 * THREADS, trips = (m + span - 1) / span;
  int s_cnt = 0;                                   // the sampled columns
  for (int it = 0; it < trips; ++it)                // warp w's 128 columns when in_sample
    for (int w = (SAMPLE_STRIDE - it % SAMPLE_STRIDE) % SAMPLE_STRIDE; w < WARPS;
         w += SAMPLE_STRIDE)
      s_cnt += max(0, min(128, m - (it * span + 128 * w)));
  const long long r = ((long long)k * s_cnt + m - 1) / m;  // the k-th key's expected rank in it
  const int need = (int)min((long long)s_cnt, r + 3 * (long long)sqrtf((float)r) + 16);
  find_bin<1>(hist, need, warp_sums, sel);
  const u32 top = (u32)sel[0];
  const int before = sel[1];
  for (int i = t; i < BINS; i += THREADS) hist[i] = 0;
  __syncthreads();
  for (int it = 0; it < trips; ++it) {
    const int i = it * span + 4 * t;
    if (i >= m || !in_sample(it)) continue;
    const Keys4 v = load4_staged(keys, i);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      hist_add(hist, (v.k[j] >> 10) & (BINS - 1), i + j < m && (v.k[j] >> 21) == top);
  }
  __syncthreads();
  find_bin<1>(hist, need - before, warp_sums, sel);
  const u32 thr = (top << 11) | (u32)sel[0];      // keys with key >> 10 >= thr pass
  u32 mine = 0;
  each_key(keys, row, m, true, aligned, [&](u32 key, int, bool valid) {
    mine += valid && (key >> 10) >= thr;
  });
  const u32 first = block_exclusive_scan<u32>(mine, warp_sums);
  if (t == THREADS - 1) sel[4] = (int)(first + mine);
  __syncthreads();
  const int passing = sel[4];
  if (passing >= k && passing <= CAND) {
    int slot = (int)first;
    each_key(keys, row, m, true, aligned, [&](u32 key, int i, bool valid) {
      if (valid && (key >> 10) >= thr) { cand_keys[slot] = key; cand_cols[slot] = i; ++slot; }
    });
    __syncthreads();
    narrow_list(cand_keys, cand_cols, passing, 0u, 32, 0, k, orow, hist, warp_sums, sel);
    return true;
  }
  for (int i = t; i < BINS; i += THREADS) hist[i] = 0;  // the sample misled: the whole row
  __syncthreads();
  each_key(keys, row, m, true, aligned, [&](u32 key, int, bool valid) {
    hist_add(hist, key >> 21, valid);
  });
  return false;
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
#if SPLIT > 1
__cluster_dims__(SPLIT, 1, 1)
#endif
decode_topk(const float* __restrict__ logits, i64 row_stride, const int* __restrict__ lens,
            int width, int k, int* __restrict__ out, i64 out_stride, int stage) {
  extern __shared__ __align__(16) unsigned char smem[];
  int* hist = reinterpret_cast<int*>(smem);               // BINS
  int* warp_sums = hist + BINS;                           // 2 * WARPS (the scans' scratch)
  int* sel = warp_sums + 2 * WARPS;                       // bin, above, in bin; [8, 9]: slice totals
  u64* bars = reinterpret_cast<u64*>(sel + 16);           // BARS
  u32* keys = reinterpret_cast<u32*>(bars + BARS);        // stage (16-byte aligned)
#if LIST
  u32* cand_keys = keys + stage;                          // CAND (CTA 0's are the list)
  int* cand_cols = reinterpret_cast<int*>(cand_keys + CAND);  // CAND
#endif

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
  const bool sampling = SAMPLE && staged && trips >= SAMPLE_MIN_TRIPS;

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
    for (int j = 0; j < 4; ++j)
      hist_add(hist, v.k[j] >> 21, i + j < m && (!sampling || in_sample(it)));
  }
#if SAMPLE
  if (sampling) {
    __syncthreads();               // the stage and the sample's histogram are whole
    if (sampled_select(keys, row, m, aligned, k, orow, hist, warp_sums, sel, cand_keys, cand_cols))
      return;
  }
#endif
  cluster_sync();
  find_bin<SPLIT>(hist, k, warp_sums, sel);
  u32 prefix = (u32)sel[0];        // the threshold key's top bits so far
  int shift = 21;                  // prefix = key >> shift
  int above = sel[1];              // keys with a larger prefix, cluster-wide
  int in_bin = sel[2];

  // Narrow over the slices while the bin is too wide to list.
  for (int p = 1; p < 3 && in_bin != k - above && (!LIST || in_bin > CAND); ++p) {
    const int next = digit_shift(p);
    cluster_sync();                // every CTA has read every `hist`
    for (int i = t; i < BINS; i += THREADS) hist[i] = 0;
    __syncthreads();
    each_key(keys, row, m, staged, aligned, [&](u32 key, int, bool valid) {
      hist_add(hist, (key >> next) & ((1u << (shift - next)) - 1),
               valid && (key >> shift) == prefix);
    });
    cluster_sync();
    find_bin<SPLIT>(hist, k - above, warp_sums, sel);
    prefix = (prefix << (shift - next)) | (u32)sel[0];
    shift = next;
    above += sel[1];
    in_bin = sel[2];
  }

  // Slots: count, block scan, the cluster's totals before this CTA.
  const int need = k - above;
  const bool take = !LIST || in_bin == need || shift == 0;  // else in_bin <= CAND: listed
  u32 n_hi = 0, n_eq = 0;                          // this thread's keys above / equal
  each_key(keys, row, m, staged, aligned, [&](u32 key, int, bool valid) {
    n_hi += valid && (key >> shift) > prefix;
    n_eq += valid && (key >> shift) == prefix;
  });
  // One scan of both counts packed in 64 bits (a slice may hold 2^31 keys).
  const u64 first = block_exclusive_scan<u64>((u64)n_hi | (u64)n_eq << 32, warp_sums);
  const u32 first_hi = (u32)first, first_eq = (u32)(first >> 32);
  if (t == THREADS - 1) {                          // this slice's totals
    sel[8] = (int)(first_hi + n_hi);
    sel[9] = (int)(first_eq + n_eq);
  }
  cluster_sync();
  if (SPLIT > 1 && t == 0) {                      // the totals of the slices before this one
    int hi = 0, eq = 0;
#pragma unroll 1
    for (u32 c = 0; c < q; ++c) { hi += *in_cta(&sel[8], c); eq += *in_cta(&sel[9], c); }
    sel[10] = hi;
    sel[11] = eq;
  }
  __syncthreads();
  int slot_hi = (int)first_hi + (SPLIT > 1 ? sel[10] : 0);
  int slot_eq = (int)first_eq + (SPLIT > 1 ? sel[11] : 0);
#if LIST
  u32* list_keys = in_cta(cand_keys, 0);
  int* list_cols = in_cta(cand_cols, 0);
#endif
  each_key(keys, row, m, staged, aligned, [&](u32 key, int i, bool valid) {
    const u32 pre = key >> shift;
    if (!valid) return;
    if (pre > prefix) {
      orow[slot_hi++] = lo + i;
    } else if (pre == prefix) {
#if LIST
      if (!take) { list_keys[slot_eq] = key; list_cols[slot_eq] = lo + i; }
      else
#endif
      if (slot_eq < need) orow[above + slot_eq] = lo + i;
      ++slot_eq;
    }
  });
#if SPLIT > 1
  cluster_sync();                  // no CTA reads another's memory after this (the list is whole)
#endif
#if LIST
  if (SPLIT == 1) __syncthreads();  // the list is whole
  if (take || q != 0) return;

  // CTA 0: narrow the listed keys (in_bin <= CAND of them) and write the rest.
  narrow_list(cand_keys, cand_cols, in_bin, prefix, shift, above, k, orow, hist, warp_sums, sel);
#endif
}
