// sm_90 (Hopper) varlen paged MQA logits: independent math warpgroups, a TMA
// ring each, one copy of the math code.  Loaded by
// vllm_dsa_varlen/ops/cuda_paged_mqa_logits.py (NVRTC, sm_90a), which documents
// the inputs; the torch reference (ops/reference.py) defines the semantics.
//
// CTA: one producer warpgroup (warp r's lane 0 feeds ring r; warp 0's also
// loads each segment's queries and weights into a double buffer) and four math
// warpgroups.  A CTA's items (pages of its segments, in order) go to math
// warpgroup i % 4; each keeps one 64 x 128 fp32 accumulator (tokens on M, a row
// group on N: two query rows x 64 heads, or four x 32 with HEADS=32) and runs
// the segment's row groups one after the other: wgmma (m64n64 over a chunk's
// last group's present rows where they fit half of it: HALF_MMA), then relu *
// weight summed over each row's heads (in the thread, then across the 4 lanes
// of a quad; a chunk's last group with absent rows skips their part), times the
// token's scale, stored where the row may look.  Segments come from the planner
// (a run's chunk of <= 2 row groups and a range of its pages): int32 [R, 8]
// rows (first row, rows, KV length, first item, items, block-table row), the
// CTA's first segment and item range.
//
// Builds (cuda_paged_mqa_logits.defines_for; all but HEAD_SUM_TC write the
// default build's bits):
//   HEADS=32              32 query heads: a row group is four rows
//   EVICT_FIRST=1         page loads with an L2 evict-first hint (a request's
//                         rows within one row group)
//   HEAD_SUM_TC=1         the head sum on the tensor cores in TF32 (group_logit_tc)
//   NUM_MATH=3 DUAL_ACC=4 the pipelined build: three math warpgroups with two
//                         accumulators each, a QK chain under the previous
//                         unit's head sum (pipe_block); 64 heads, fp32 sum
//   PDL=1                 launched as a programmatic dependent
//   HALF_MMA=0            the host's build where ptxas serialises the default's
//                         wgmmas

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned char u8;

#ifndef EVICT_FIRST
#define EVICT_FIRST 0
#endif
#ifndef PDL  // 1: the CTAs set up their barriers and fetch their TMA descriptors under
#define PDL 0   // the previous kernel's tail, then wait for it before their first global read
#endif
#ifndef HEAD_SUM_TC
#define HEAD_SUM_TC 0
#endif
#ifndef NUM_MATH  // math warpgroups: 4, or 3 in the pipelined build
#define NUM_MATH 4
#endif
#ifndef DUAL_ACC  // the pipelined build's pages per block of a chunk of two full row groups
#define DUAL_ACC 0
#endif
#if !((NUM_MATH == 4 && DUAL_ACC == 0) || (NUM_MATH == 3 && DUAL_ACC == 4))
#error "NUM_MATH=3 comes with DUAL_ACC=4 (the pipelined build), NUM_MATH=4 without DUAL_ACC"
#endif
#define GMAX 2
#define STAGES 3          // pages in flight per ring (the host's smem_bytes assumes 3)
#define RAMP_ITEMS 96     // a CTA of at most this many items fills its rings a page at a time
#define MATH_REGS (NUM_MATH == 4 ? 104 : 160)   // registers per thread after setmaxnreg
#define PRODUCER_REGS (DUAL_ACC ? 24 : 40)
#define THREADS (128 * (NUM_MATH + 1))
#define PAGE 64
#define DIM 128
#ifndef HEADS       // 64 or 32 query heads: a row group is RG rows x HEADS heads = 128 columns
#define HEADS 64
#endif
#define RG (128 / HEADS)   // rows per row group
#ifndef HALF_MMA      // 1: a row group with absent rows (a chunk's last) runs its QK wgmma
#define HALF_MMA (NUM_MATH == 4)  // over half its columns where its present rows fit there
#endif                // (m64n64: a 64-head half group, 1-2 of 4 rows at 32 heads)
#if HALF_MMA && NUM_MATH != 4
#error "HALF_MMA is a build of four math warpgroups"
#endif
// A wgmma chain's descriptors as its first ones plus 2 a step (fewer uniform ops):
// with HALF_MMA, NVRTC 13.0's ptxas serialises the wgmmas otherwise.
#define DESC_STEP HALF_MMA
#if DUAL_ACC && (RG != 2 || HEAD_SUM_TC)
#error "DUAL_ACC is a build of 3 math warpgroups, 64 heads, the CUDA-core head sum"
#endif
#define HB (HEADS / 8)     // 8-column blocks per row
#define ROWS_MAX (GMAX * RG)
#define PAGE_BYTES (PAGE * DIM)
#define SLOT_BYTES PAGE_BYTES                                  // ring slot (1 KB aligned)
#define LOAD_BYTES (PAGE_BYTES + PAGE * 4)                      // a page's values + scales
#define Q_GROUP_BYTES (RG * HEADS * DIM)
// HEAD_SUM_TC: a row group's weights as the tensor-core head sum's B fragments,
// per lane class s (8 classes of 8 float4 at a stride of 9 float4: conflict-free
// 128-bit loads); each math warpgroup keeps its own copy, double-buffered.
#define WT_CLASS_F4 9
#define WT_GROUP_BYTES (8 * WT_CLASS_F4 * 16)
#define WT_BYTES (HEAD_SUM_TC ? NUM_MATH * 2 * GMAX * WT_GROUP_BYTES : 0)
#define DEV __device__ __forceinline__

struct __align__(64) TmaMap { u64 bytes[16]; };

DEV u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

DEV void bar_init(u64* bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count));
}
DEV void bar_expect(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
DEV void bar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}
DEV void bar_wait(u64* bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}
DEV void tma_3d(void* dst, const TmaMap* map, int c0, int c1, int c2, u64* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];"
      :: "r"(smem_addr(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
}
DEV void tma_3d_hint(void* dst, const TmaMap* map, int c0, int c1, int c2, u64* bar, u64 policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3, %4}], [%5], %6;"
      :: "r"(smem_addr(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}
DEV void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
// K-major operand in 128-byte-swizzled rows of 128 bytes (8-row atoms of 1 KB).
DEV u64 sw128_desc(const void* p) {
  u64 d = (smem_addr(p) & 0x3FFFF) >> 4;
  d |= u64(1) << 16;
  d |= u64(1024 >> 4) << 32;
  d |= u64(1) << 62;
  return d;
}
DEV void mma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
DEV void mma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
DEV void mma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
DEV void mma_64x128x32(float (&d)[64], u64 desc_a, u64 desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// The first 64 columns of mma_64x128x32 (d[0, 32): the same registers hold
// the same (token, column) elements in both), for a row group's present rows
// (HALF_MMA).
DEV void mma_64x64x32(float (&d)[64], u64 desc_a, u64 desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// A descriptor moved 32 bytes along K per step: the start address (bits 0-13,
// 16-byte units) + 2; a tile ends below 256 KB, so no carry leaves the field.
DEV u64 desc_at(u64 first, const void* p, int kk) {
  return DESC_STEP ? first + u64(2 * kk) : sw128_desc(static_cast<const u8*>(p) + 32 * kk);
}

struct Seg { int first_row, n_rows, kv_len, page_lo, page_hi, item_base, bt_row; };

// Segment k of this CTA's item range [lo, hi), its fields warp-uniform (the
// wgmma is .sync.aligned: the compiler must see uniform control flow).
DEV Seg load_seg(const int* table, int k, int lo, int hi) {
  const int4 a = __ldg(reinterpret_cast<const int4*>(table + 8 * k));
  const int4 b = __ldg(reinterpret_cast<const int4*>(table + 8 * k) + 1);
  const int off = __shfl_sync(0xffffffffu, a.w, 0), items = __shfl_sync(0xffffffffu, b.x, 0);
  Seg s;
  s.first_row = __shfl_sync(0xffffffffu, a.x, 0);
  s.n_rows = __shfl_sync(0xffffffffu, a.y, 0);
  s.kv_len = __shfl_sync(0xffffffffu, a.z, 0);
  s.bt_row = __shfl_sync(0xffffffffu, b.y, 0);
  s.page_lo = max(lo - off, 0);
  s.page_hi = min(hi - off, items);
  s.item_base = off + s.page_lo - lo;
  if (off >= hi) s.page_hi = -1;  // past the CTA's range: the walk ends
  return s;
}

// A segment's first page (in [page_lo, page_hi)) that goes to ring r.
DEV int first_page(const Seg& s, int r) {
  return s.page_lo + (((r - s.item_base) % NUM_MATH) + NUM_MATH) % NUM_MATH;
}

// One row group of one page: the wgmma chain into acc, the slot handed back
// (slot_empty) when this is the page's last group (release).  cols (HALF_MMA
// builds; a constant at each call): 64: the group's first 64 columns only
// (acc[0, 32): its present rows' heads where they fit there).
DEV void qk_group(float (&acc)[64], const u8* page, const u8* qg, u64* slot_empty, bool release,
                  int lane, int cols = 128) {
  mma_fence();
  const u64 a0 = sw128_desc(page), b0 = sw128_desc(qg);
#pragma unroll
  for (int kk = 0; kk < DIM / 32; ++kk) {
    const u64 a = desc_at(a0, page, kk), b = desc_at(b0, qg, kk);
    if (HALF_MMA && cols == 64) mma_64x64x32(acc, a, b, kk > 0);
    else mma_64x128x32(acc, a, b, kk > 0);
  }
  mma_commit();
  mma_wait();
  if (release) {  // every read of the slot is done: hand it back
    __syncwarp();
    if (lane == 0) bar_arrive(slot_empty);
  }
}

#if DUAL_ACC
// A row group's QK chain issued and committed, not waited (DUAL_ACC); half:
// over its first 64 columns (its first row's heads).
DEV void qk_issue(float (&acc)[64], const u8* page, const u8* qg, bool half) {
  mma_fence();
  const u64 a0 = sw128_desc(page), b0 = sw128_desc(qg);
#pragma unroll
  for (int kk = 0; kk < DIM / 32; ++kk) {
    if (half) mma_64x64x32(acc, desc_at(a0, page, kk), desc_at(b0, qg, kk), kk > 0);
    else mma_64x128x32(acc, desc_at(a0, page, kk), desc_at(b0, qg, kk), kk > 0);
  }
  mma_commit();
}
DEV void mma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
#endif

// A lane's weights of 8-column block n of its row group (heads 8 (n % 8) + 2q,
// + 1 of row n / 8), read from the chunk's copy in shared memory per page.
struct SmemWeights {
  const float* p;  // the group's weights, at this lane's 2q
  DEV float2 operator[](int n) const { return *reinterpret_cast<const float2*>(p + 8 * n); }
};
// Row group g's weights in the chunk's copy (buffer b), at lane's 2q.
DEV SmemWeights group_weights(const float* w_buf, int b, int g, int lane) {
  return {w_buf + (b * ROWS_MAX + RG * g) * HEADS + 2 * (lane & 3)};
}

// One row group of one page (two rows x 64 heads): qk_group, then relu *
// weight summed over each row's heads, in the thread (16 columns per row;
// n_end = 8: row 2g only), then across the quad; returns this lane's (token,
// row) logit before the scale.
template <class Weights>
DEV float group_sum(const float (&acc)[64], const Weights& wq, int lane, int n_end);

template <class Weights>
DEV float group_logit(float (&acc)[64], const u8* page, const u8* qg, const Weights& wq,
                      u64* slot_empty, bool release, int lane, int n_end) {
  qk_group(acc, page, qg, slot_empty, release, lane, n_end == 8 ? 64 : 128);
  return group_sum(acc, wq, lane, n_end);
}

// group_logit's head sum over a row group's accumulator.
template <class Weights>
DEV float group_sum(const float (&acc)[64], const Weights& wq, int lane, int n_end) {
  const int t_hi = lane & 1, q_hi = (lane >> 1) & 1;
  float s00 = 0.f, s01 = 0.f, s10 = 0.f, s11 = 0.f;   // s[token half][row]
#pragma unroll
  for (int n = 0; n < 16; ++n) {  // columns 8n + 2 * (lane & 3) + {0, 1}: row n / 8
    if (n >= n_end) break;
    const float2 wv = wq[n];
    const float a0 = fmaxf(acc[4 * n + 0], 0.f), a1 = fmaxf(acc[4 * n + 1], 0.f);
    const float a2 = fmaxf(acc[4 * n + 2], 0.f), a3 = fmaxf(acc[4 * n + 3], 0.f);
    if (n < 8) { s00 = fmaf(a0, wv.x, s00); s00 = fmaf(a1, wv.y, s00);
                 s10 = fmaf(a2, wv.x, s10); s10 = fmaf(a3, wv.y, s10); }
    else       { s01 = fmaf(a0, wv.x, s01); s01 = fmaf(a1, wv.y, s01);
                 s11 = fmaf(a2, wv.x, s11); s11 = fmaf(a3, wv.y, s11); }
  }
  // sum over the quad's 4 lanes, each lane ending with its (token, row)
  float k0 = t_hi ? s10 : s00, k1 = t_hi ? s11 : s01;
  const float o0 = t_hi ? s00 : s10, o1 = t_hi ? s01 : s11;
  k0 += __shfl_xor_sync(0xffffffffu, o0, 1);
  k1 += __shfl_xor_sync(0xffffffffu, o1, 1);
  float v = q_hi ? k1 : k0;
  v += __shfl_xor_sync(0xffffffffu, q_hi ? k0 : k1, 2);
  return v;
}

#if RG == 4
// group_logit for a row group of four rows x 32 heads: a lane's 16 columns per
// token are 4 per row (block n: row n / 4); each lane ends with row q = lane % 4
// of its tokens g and g + 8 (.x, .y), summed across the quad (6 shuffles).
// present: the group's rows that exist (4 in the full copy).
DEV float2 group_logit4(float (&acc)[64], const u8* page, const u8* qg, const float* wq,
                        u64* slot_empty, bool release, int lane, int present, int cols = 128) {
  qk_group(acc, page, qg, slot_empty, release, lane, cols);
  float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // [token half][row]
#pragma unroll
  for (int n = 0; n < 16; ++n) {  // columns 8n + 2 * (lane & 3) + {0, 1}: row n / 4
    if (n >= HB * present) break;
    const float2 wv = *reinterpret_cast<const float2*>(wq + 8 * n);
    const float a0 = fmaxf(acc[4 * n + 0], 0.f), a1 = fmaxf(acc[4 * n + 1], 0.f);
    const float a2 = fmaxf(acc[4 * n + 2], 0.f), a3 = fmaxf(acc[4 * n + 3], 0.f);
    s[0][n / HB] = fmaf(a0, wv.x, s[0][n / HB]);
    s[0][n / HB] = fmaf(a1, wv.y, s[0][n / HB]);
    s[1][n / HB] = fmaf(a2, wv.x, s[1][n / HB]);
    s[1][n / HB] = fmaf(a3, wv.y, s[1][n / HB]);
  }
  // across the quad: lanes l and l ^ 2 split rows {0, 1} / {2, 3}, then l and
  // l ^ 1 split those two, so lane q keeps row q
  const int hi = (lane >> 1) & 1, lo = lane & 1;
  float k[2][2], v[2];
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      k[t][j] = (hi ? s[t][2 + j] : s[t][j])
                + __shfl_xor_sync(0xffffffffu, hi ? s[t][j] : s[t][2 + j], 2);
#pragma unroll
  for (int t = 0; t < 2; ++t)
    v[t] = (lo ? k[t][1] : k[t][0]) + __shfl_xor_sync(0xffffffffu, lo ? k[t][0] : k[t][1], 1);
  return make_float2(v[0], v[1]);
}
#endif

#if HEAD_SUM_TC
// ---- the head sum on the tensor cores ------------------------------------
// After the QK wgmma, warp w's accumulator holds tokens 16w + g and 16w + g + 8
// (g = lane / 4) and, in each 8-column block n (row n / 8 of the group, heads
// 8 (n % 8) + 2q, + 1 with q = lane % 4), columns 2q and 2q + 1: acc[4n + {0,
// 1}] for token g, acc[4n + {2, 3}] for token g + 8.  That is the row layout of
// mma.m16n8k8's A and C fragments (PTX ISA: a0 (g, q), a1 (g + 8, q), a2 (g,
// q + 4), a3 (g + 8, q + 4)); column 2q goes to k = q and 2q + 1 to k = q + 4
// (the sum over heads is order-free, and B's rows follow the same map).  So
// relu(acc), rounded to TF32 (cvt.rn.relu.tf32.f32: one instruction), is the A
// operand of 8 m16n8k8 per row with no data movement; B (k8 x n8) holds the
// block's row's weights in every column, their TF32 high part in even columns
// and the rest (w - hi, rounded) in odd ones, so the accumulator D of a row's
// chain holds, for tokens g and g + 8, hi in column 2q and lo in 2q + 1 for
// every quad lane q: lo + hi is the row's logit (weights to ~22 bits; only
// relu(q . k) is rounded).  B fragment: b0 = (k q, n g), b1 = (k q + 4, n g);
// lane (g, q) takes the weights of heads 8j + 2q, + 1, high part when g is
// even, low part when odd: its class s = 4 (g & 1) + q, 32 floats per group.
DEV u32 relu_tf32(float x) {
  u32 r;
  asm("cvt.rn.relu.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
DEV float round_tf32(float x) {
  u32 r;
  asm("cvt.rn.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}
DEV void mma_tf32(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, float b0, float b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}
// Block n of acc (a row's 8 heads) into D.
DEV void head_block(float (&d)[4], const float (&acc)[64], int n, float b0, float b1) {
  mma_tf32(d, relu_tf32(acc[4 * n]), relu_tf32(acc[4 * n + 2]), relu_tf32(acc[4 * n + 1]),
           relu_tf32(acc[4 * n + 3]), b0, b1);
}

// A chunk's weights (rows [0, n_rows) of w, HEADS each) as the B fragments of
// its groups (wt: this warpgroup's buffer of GMAX groups): float4 u of class s
// holds blocks n = 2u, 2u + 1 of the group (row RG * group + n / HB, heads
// 8 (n % HB) + 2q, + 1), high part (s < 4) or low part; rows past n_rows are 0.
// Each of the warpgroup's threads writes 4 of the <= 512 floats, then the
// warpgroup meets at its named barrier (id 1 + ring).
DEV void weights_tf32(u8* wt, const float* w, int n_rows, int ring, int tid) {
  const int groups = (n_rows + RG - 1) / RG;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int idx = tid + 128 * i;
    if (idx < groups * 256) {
      const int gi = idx >> 8, s = (idx >> 5) & 7, u = (idx >> 2) & 7, e = idx & 3;
      const int n = 2 * u + (e >> 1);  // the block in the group
      const int row = RG * gi + n / HB;
      const int head = 8 * (n % HB) + 2 * (s & 3) + (e & 1);
      const float x = row < n_rows ? w[row * HEADS + head] : 0.f;
      const float hi = round_tf32(x);
      reinterpret_cast<float*>(wt + gi * WT_GROUP_BYTES)[4 * (WT_CLASS_F4 * s + u) + e] =
          s < 4 ? hi : round_tf32(x - hi);
    }
  }
  asm volatile("bar.sync %0, 128;" :: "r"(1 + ring) : "memory");
}

// group_logit with the head sum on the tensor cores (above); wt: this lane's
// class of the group's B fragments; half: the group's second row is absent.
DEV float group_logit_tc(float (&acc)[64], const u8* page, const u8* qg, const float4* wt,
                         u64* slot_empty, bool release, int lane, bool half) {
  const int t_hi = lane & 1, q_hi = (lane >> 1) & 1;
  qk_group(acc, page, qg, slot_empty, release, lane, half ? 64 : 128);
  float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};  // rows 0, 1
#pragma unroll
  for (int u = 0; u < 4; ++u) {  // the two rows' chains interleaved
    const float4 b = wt[u];
    head_block(d0, acc, 2 * u, b.x, b.y);
    head_block(d0, acc, 2 * u + 1, b.z, b.w);
    if (!half) {
      const float4 c = wt[4 + u];
      head_block(d1, acc, 8 + 2 * u, c.x, c.y);
      head_block(d1, acc, 9 + 2 * u, c.z, c.w);
    }
  }
  // this lane's (token, row): hi + lo
  const float hi = q_hi ? (t_hi ? d1[2] : d1[0]) : (t_hi ? d0[2] : d0[0]);
  const float lo = q_hi ? (t_hi ? d1[3] : d1[1]) : (t_hi ? d0[3] : d0[1]);
  return hi + lo;
}

#if RG == 4
// group_logit4 with the head sum on the tensor cores: row r's chain is blocks
// 4r .. 4r + 3 (float4s 2r, 2r + 1 of the lane's class); lane q takes row q of
// its tokens g (.x) and g + 8 (.y).  present: the group's rows that exist.
DEV float2 group_logit4_tc(float (&acc)[64], const u8* page, const u8* qg, const float4* wt,
                           u64* slot_empty, bool release, int lane, int present) {
  qk_group(acc, page, qg, slot_empty, release, lane);
  float d[4][4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    d[r][0] = d[r][1] = d[r][2] = d[r][3] = 0.f;
    if (r < present) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float4 b = wt[2 * r + h];
        head_block(d[r], acc, 4 * r + 2 * h, b.x, b.y);
        head_block(d[r], acc, 4 * r + 2 * h + 1, b.z, b.w);
      }
    }
  }
  const int q = lane & 3;
  float v0 = d[0][0] + d[0][1], v1 = d[0][2] + d[0][3];  // hi + lo of tokens g, g + 8
#pragma unroll
  for (int r = 1; r < 4; ++r) {
    v0 = q == r ? d[r][0] + d[r][1] : v0;
    v1 = q == r ? d[r][2] + d[r][3] : v1;
  }
  return make_float2(v0, v1);
}
#endif
#endif

#if DUAL_ACC
// The two-deep pipeline (DUAL_ACC): a chunk's units (page, row group), in
// order, go alternately into acc and acc2, and unit i + 1's QK chain runs
// under unit i's head sum.  G: the chunk's row groups (1 or 2); half: its last
// group has one row.  One block: K consecutive pages of this warpgroup from
// page p (item j of its ring), all chains waited for at its end (chains
// pending across a loop's back edge make NVRTC's ptxas serialise every wgmma
// of the kernel).  A page's slot goes back once its last unit's chain is done;
// its scale is read before.
struct Chunk {
  const u8* q;            // the chunk's first row group's queries (the second follows)
  SmemWeights w[GMAX];    // its groups' weights, at this lane
  float* o[GMAX];         // this lane's row of each group
  int lim[GMAX];          // this lane's row's visible tokens, per group
};

template <int G, int K, bool HALF>
DEV void pipe_block(float (&acc)[64], float (&acc2)[64], const Chunk& c, int p, int& j, int ring,
                    int tok, int lane, u8* kv_ring, const float* sc_ring, u64* full, u64* empty) {
  constexpr int N = G * K;
  // unit v's chain: into acc (v even) or acc2, its page's slot waited for
  // when v is the page's first unit; a two-group chunk's half group's over
  // its first 64 columns
  auto issue = [&](int v) {
    const int t = v / G, g = v % G, slot = ring * STAGES + (j + t) % STAGES;
    if (g == 0) bar_wait(&full[slot], ((j + t) / STAGES) & 1);
    const u8* page = kv_ring + slot * SLOT_BYTES;
    const u8* qg = c.q + g * Q_GROUP_BYTES;
    const bool half = HALF && G == 2 && g == 1;
    if (v % 2 == 0) qk_issue(acc, page, qg, half);
    else qk_issue(acc2, page, qg, half);
  };
  // is unit v issued before step v - 1 waits: a page's second unit, at step
  // v - 2's end; a page's first one only once the page before is handed back
  // (issuing it earlier, under the page before's second head sum, was no faster)
  auto early = [](int v) { return v % G != 0; };
  float scale = 0.f;
  issue(0);
  if (N > 1 && early(1)) issue(1);
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const int t = u / G, g = u % G, slot = ring * STAGES + (j + t) % STAGES;
    const bool next = u + 1 < N, pre = next && early(u + 1);
    if (pre) mma_wait1(); else mma_wait();
    if (g == 0) scale = sc_ring[slot * PAGE + tok];
    if (g == G - 1) {  // the page's last chain done: its slot goes back
      __syncwarp();
      if (lane == 0) bar_arrive(&empty[slot]);
    }
    if (next && !pre) issue(u + 1);
    const int n_end = HALF && g == G - 1 ? 8 : 16;
    const float v = u % 2 == 0 ? group_sum(acc, c.w[g], lane, n_end)
                               : group_sum(acc2, c.w[g], lane, n_end);
    const int pos = (p + t * NUM_MATH) * PAGE + tok;
    if (pos < c.lim[g]) c.o[g][pos] = v * scale;
    if (u + 2 < N && early(u + 2)) issue(u + 2);
  }
  j += K;
}

// A chunk's pages of this warpgroup: blocks of K pages (DUAL_ACC pages of two
// full row groups; four units for other chunks: 2 pages of a two-group chunk
// with a half group, 4 of one group), then of 2, then 1.  (Blocks of DUAL_ACC
// pages for every chunk grow the code enough to slow variable steps, which run
// every copy: instruction fetch.)
template <int G, bool HALF>
DEV void pipe_pages(float (&acc)[64], float (&acc2)[64], const Chunk& c, const Seg& s, int& j,
                    int ring, int tok, int lane, u8* kv_ring, const float* sc_ring, u64* full,
                    u64* empty) {
  constexpr int K = G == 2 && !HALF ? DUAL_ACC : 4 / G;
  int p = first_page(s, ring);
  for (; p + (K - 1) * NUM_MATH < s.page_hi; p += K * NUM_MATH)
    pipe_block<G, K, HALF>(acc, acc2, c, p, j, ring, tok, lane, kv_ring, sc_ring, full, empty);
  if (K > 2 && p + NUM_MATH < s.page_hi) {
    pipe_block<G, 2, HALF>(acc, acc2, c, p, j, ring, tok, lane, kv_ring, sc_ring, full, empty);
    p += 2 * NUM_MATH;
  }
  for (; p < s.page_hi; p += NUM_MATH)
    pipe_block<G, 1, HALF>(acc, acc2, c, p, j, ring, tok, lane, kv_ring, sc_ring, full, empty);
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1)
varlen_logits_sm90(const __grid_constant__ TmaMap kv_map, const __grid_constant__ TmaMap q_map,
                   const u8* __restrict__ kv, long long stride_block,
                   const float* __restrict__ w, int stride_w,
                   const int* __restrict__ ctx, const int* __restrict__ bt, int stride_bt,
                   float* __restrict__ out, long long stride_out,
                   const int* __restrict__ table, const int* __restrict__ ctas, int num_segs) {
  extern __shared__ __align__(1024) u8 smem_raw[];
  // 1 KB alignment for the swizzled tiles, by pointer arithmetic on the shared
  // array (a round trip through an integer loses the address space)
  u8* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  u8* kv_ring = smem;                                             // [NUM_MATH][STAGES][SLOT_BYTES]
  u8* q_buf = kv_ring + NUM_MATH * STAGES * SLOT_BYTES;           // [2][GMAX][Q_GROUP_BYTES]
  float* sc_ring = reinterpret_cast<float*>(q_buf + 2 * GMAX * Q_GROUP_BYTES);  // [NUM_MATH][STAGES][PAGE]
  float* w_buf = sc_ring + NUM_MATH * STAGES * PAGE;              // [2][ROWS_MAX][HEADS]
  u8* wt_buf = reinterpret_cast<u8*>(w_buf + 2 * ROWS_MAX * HEADS);  // [NUM_MATH][2][GMAX] (TC)
  u64* full = reinterpret_cast<u64*>(wt_buf + WT_BYTES);
  u64* empty = full + NUM_MATH * STAGES;
  u64* q_full = empty + NUM_MATH * STAGES;
  u64* q_empty = q_full + 2;

  const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  const int warp = __shfl_sync(0xffffffffu, (threadIdx.x / 32) % 4, 0), lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int i = 0; i < NUM_MATH * STAGES; ++i) { bar_init(&full[i], 1); bar_init(&empty[i], 4); }
    for (int i = 0; i < 2; ++i) { bar_init(&q_full[i], 1); bar_init(&q_empty[i], 4 * NUM_MATH); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#if PDL
    // the descriptors are launch parameters, not another kernel's output
    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<u64>(&kv_map)) : "memory");
    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<u64>(&q_map)) : "memory");
#endif
  }
  __syncthreads();
#if PDL
  // Every global read below may see the previous kernel's writes (queries,
  // weights, the cache, the schedule), and the logits may be what it reads:
  // wait for its grid to finish and its writes to land.  Then let the next
  // kernel launch (its CTAs take SMs as this kernel's leave; a dependent waits
  // for this grid the same way).  Without the launch attribute both are no-ops.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const int4 cta = __ldg(reinterpret_cast<const int4*>(ctas) + blockIdx.x);
  const int seg0 = __shfl_sync(0xffffffffu, cta.x, 0);
  const int lo = __shfl_sync(0xffffffffu, cta.y, 0), hi = __shfl_sync(0xffffffffu, cta.z, 0);

  if (wg == 0) {  // producers
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(PRODUCER_REGS));
#if NUM_MATH < 4
    if (warp >= NUM_MATH) return;  // rings 0 .. NUM_MATH - 1
#endif
    if (lane != 0) return;
    const int ring = warp;
    int j = 0;
    for (int k = 0; seg0 + k < num_segs; ++k) {
      const Seg s = load_seg(table, seg0 + k, lo, hi);
      if (s.page_hi < 0) break;
      if (ring == 0) {
        const int b = k & 1, groups = (s.n_rows + RG - 1) / RG;
        bar_wait(&q_empty[b], ((k >> 1) & 1) ^ 1);
        bar_expect(&q_full[b], groups * Q_GROUP_BYTES + s.n_rows * HEADS * 4);
        for (int g = 0; g < groups; ++g)
          tma_3d(q_buf + (b * GMAX + g) * Q_GROUP_BYTES, &q_map, 0, 0, s.first_row + RG * g,
                 &q_full[b]);
        bulk_copy(w_buf + b * ROWS_MAX * HEADS, w + (long long)s.first_row * stride_w,
                  s.n_rows * HEADS * 4, &q_full[b]);
      }
      const int* bt_row = bt + (long long)s.bt_row * stride_bt;
      for (int p = first_page(s, ring); p < s.page_hi; p += NUM_MATH, ++j) {
        const int block = __ldg(bt_row + p);
        const int slot = ring * STAGES + j % STAGES;
        // At the start every CTA's rings ask for STAGES pages at once, and a
        // ring's first page queues behind the others' later ones: where a CTA
        // has few items, ask for each page once the one before has landed.
        // Phase 0 of the slot waited on completes before the ring issues any
        // later page into it: no later phase aliases.
        if (j > 0 && j < STAGES && (hi - lo <= RAMP_ITEMS))
          bar_wait(&full[ring * STAGES + (j - 1)], 0);
        bar_wait(&empty[slot], ((j / STAGES) & 1) ^ 1);
        bar_expect(&full[slot], LOAD_BYTES);
#if EVICT_FIRST
        u64 policy;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
        tma_3d_hint(kv_ring + slot * SLOT_BYTES, &kv_map, 0, 0, block, &full[slot], policy);
#else
        tma_3d(kv_ring + slot * SLOT_BYTES, &kv_map, 0, 0, block, &full[slot]);
#endif
        bulk_copy(sc_ring + slot * PAGE, kv + block * stride_block + PAGE_BYTES, PAGE * 4,
                  &full[slot]);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(MATH_REGS));
  const int ring = wg - 1;
#if RG == 2
  const int t_hi = lane & 1, q_hi = (lane >> 1) & 1;   // the (token, row) this lane stores
  const int tok = warp * 16 + (lane >> 2) + 8 * t_hi;   // token in the page
#else
  const int q_hi = lane & 3;                            // the row of a group this lane stores,
  const int tok = warp * 16 + (lane >> 2);              // for tokens tok and tok + 8
#endif
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
#if DUAL_ACC
  float acc2[64];  // the pipeline's second accumulator (pipe_block)
#pragma unroll
  for (int i = 0; i < 64; ++i) acc2[i] = 0.f;
#endif
  int j = 0;
  for (int k = 0; seg0 + k < num_segs; ++k) {
    const Seg s = load_seg(table, seg0 + k, lo, hi);
    if (s.page_hi < 0) break;
    const int b = k & 1, groups = (s.n_rows + RG - 1) / RG;
    int lim[GMAX];  // this lane's row's last visible token + 1, per group
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      const int r = RG * g + q_hi;
      lim[g] = (r < s.n_rows) ? min(__ldg(ctx + s.first_row + r), s.kv_len) : 0;
    }
    bar_wait(&q_full[b], (k >> 1) & 1);
#if HEAD_SUM_TC
    u8* wt_seg = wt_buf + (ring * 2 + b) * GMAX * WT_GROUP_BYTES;
    weights_tf32(wt_seg, w_buf + b * ROWS_MAX * HEADS, s.n_rows, ring, threadIdx.x % 128);
    const float4* wt_lane = reinterpret_cast<const float4*>(
        wt_seg + 16 * WT_CLASS_F4 * (4 * ((lane >> 2) & 1) + (lane & 3)));
#endif
#if DUAL_ACC
    Chunk c;
    c.q = q_buf + b * GMAX * Q_GROUP_BYTES;
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      c.w[g] = group_weights(w_buf, b, g, lane);
      c.o[g] = out + (long long)(s.first_row + RG * g + q_hi) * stride_out;
      c.lim[g] = lim[g];
    }
    if (groups == 2) {
      if (s.n_rows == ROWS_MAX)
        pipe_pages<2, false>(acc, acc2, c, s, j, ring, tok, lane, kv_ring, sc_ring, full, empty);
      else
        pipe_pages<2, true>(acc, acc2, c, s, j, ring, tok, lane, kv_ring, sc_ring, full, empty);
    } else {
      if (s.n_rows == RG)
        pipe_pages<1, false>(acc, acc2, c, s, j, ring, tok, lane, kv_ring, sc_ring, full, empty);
      else
        pipe_pages<1, true>(acc, acc2, c, s, j, ring, tok, lane, kv_ring, sc_ring, full, empty);
    }
#else
    for (int p = first_page(s, ring); p < s.page_hi; p += NUM_MATH, ++j) {
      const int slot = ring * STAGES + j % STAGES;
      bar_wait(&full[slot], (j / STAGES) & 1);
      const u8* page = kv_ring + slot * SLOT_BYTES;
#if RG == 2
      const float scale = sc_ring[slot * PAGE + tok];
#else
      const float scale0 = sc_ring[slot * PAGE + tok], scale1 = sc_ring[slot * PAGE + tok + 8];
#endif
      const int pos = p * PAGE + tok;
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        if (g < groups) {
          const u8* qg = q_buf + (b * GMAX + g) * Q_GROUP_BYTES;
#if RG == 2
          // a chunk's odd last row (a half group) runs the full wgmma (HALF_MMA: its
          // row's 64 heads only) and only its row's epilogue, in a code copy of
          // its own (a branch inside one copy's epilogue slowed full groups)
#if HEAD_SUM_TC
          const float4* wt = wt_lane + g * (WT_GROUP_BYTES / 16);
          const float v = 2 * g + 1 < s.n_rows
              ? group_logit_tc(acc, page, qg, wt, &empty[slot], g == groups - 1, lane, false)
              : group_logit_tc(acc, page, qg, wt, &empty[slot], g == groups - 1, lane, true);
#else
          const SmemWeights wq = group_weights(w_buf, b, g, lane);
          const float v = 2 * g + 1 < s.n_rows
              ? group_logit(acc, page, qg, wq, &empty[slot], g == groups - 1, lane, 16)
              : group_logit(acc, page, qg, wq, &empty[slot], g == groups - 1, lane, 8);
#endif
          if (pos < lim[g])
            out[(long long)(s.first_row + 2 * g + q_hi) * stride_out + pos] = v * scale;
#else
          // a chunk's last group with absent rows: a code copy of its own
          const int present = min(s.n_rows - RG * g, RG);
#if HEAD_SUM_TC
          const float4* wt = wt_lane + g * (WT_GROUP_BYTES / 16);
          const float2 v = present == RG
              ? group_logit4_tc(acc, page, qg, wt, &empty[slot], g == groups - 1, lane, RG)
              : group_logit4_tc(acc, page, qg, wt, &empty[slot], g == groups - 1, lane, present);
#else
          const float* wq = group_weights(w_buf, b, g, lane).p;
#if HALF_MMA  // one or two present rows: a copy of its own with the m64n64 wgmma
          // (n32 / n96 copies as well: ptxas serialises the wgmmas, registers)
          const float2 v = present == RG
              ? group_logit4(acc, page, qg, wq, &empty[slot], g == groups - 1, lane, RG)
              : present > 2
              ? group_logit4(acc, page, qg, wq, &empty[slot], g == groups - 1, lane, present)
              : group_logit4(acc, page, qg, wq, &empty[slot], g == groups - 1, lane, present, 64);
#else
          const float2 v = present == RG
              ? group_logit4(acc, page, qg, wq, &empty[slot], g == groups - 1, lane, RG)
              : group_logit4(acc, page, qg, wq, &empty[slot], g == groups - 1, lane, present);
#endif
#endif
          float* o = out + (long long)(s.first_row + RG * g + q_hi) * stride_out;
          if (pos < lim[g]) o[pos] = v.x * scale0;
          if (pos + 8 < lim[g]) o[pos + 8] = v.y * scale1;
#endif
        }
      }
    }
#endif  // DUAL_ACC
    __syncwarp();
    if (lane == 0) bar_arrive(&q_empty[b]);
  }
}
