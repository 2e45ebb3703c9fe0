// Spike: sm_90 varlen paged MQA logits with four independent math warpgroups
// (one TMA ring each, one code copy), the structure DeepGEMM's SM90 kernel
// uses, to measure whether it moves the time per page that every Gluon
// structure of this project left at ~1100 cycles (docs/kernel-notes.md).
// Not wired into the plugin: benchmarks/spikes/sm90_cuda_rings.py builds it
// with nvcc, loads it through the driver API and times it beside v7.
//
// Schedule: the host lists each CTA's segments (a run's chunk of <= 2*GMAX
// rows and a range of its pages); the CTA's items (pages) are numbered in
// order and item i goes to math warpgroup i % 4.
//
// Compile-time knobs: GMAX (row groups of 2 rows per segment, 1 or 2),
// STAGES (ring depth per warpgroup), NOEPI (skip the epilogue: pipeline + wgmma
// only), MATH_REGS.
#include <stdint.h>

#ifndef GMAX
#define GMAX 2
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef MATH_REGS
#define MATH_REGS 104
#endif
#ifndef PRODUCER_REGS
#define PRODUCER_REGS 40
#endif
#ifndef NOEPI
#define NOEPI 0
#endif
#ifndef NOSTORE   // epilogue computed, store under a condition never met
#define NOSTORE 0
#endif
#ifndef CONSTW    // weights as constants instead of shared-memory loads
#define CONSTW 0
#endif
#ifndef W128      // weights re-laid per segment (per warpgroup, lane-contiguous): 8 LDS.128 per group-page
#define W128 0
#endif
#ifndef WSCALAR   // timing only: one weight register per lane for every head (no loads)
#define WSCALAR 0
#endif
#ifndef PRELOAD   // the group's weights loaded from shared memory while its wgmma runs
#define PRELOAD 0
#endif
#ifndef WAITFENCE // wgmma wait without a memory clobber; accumulator ordered by register fences
#define WAITFENCE 0
#endif
#define WPAD 36   // W128: floats per lane-set (144 B: the 4 lane-sets' 16-byte reads in distinct banks)
#ifndef REGW      // the warpgroup's one row group's weights held in registers per segment (GMAX == SPLIT)
#define REGW 0
#endif
#ifndef SPLIT     // math warpgroups per ring: 2 = a pair shares each page, one takes even groups, one odd
#define SPLIT 1
#endif

#define NUM_MATH 4
#define RINGS (NUM_MATH / SPLIT)
#define THREADS (128 * (NUM_MATH + 1))
#define PAGE 64
#define DIM 128
#define HEADS 64
#define PAGE_BYTES (PAGE * DIM)          // fp8 values of one page
#define Q_GROUP_BYTES (2 * HEADS * DIM)  // two query rows
#define DEV __device__ __forceinline__

DEV uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

DEV void bar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count));
}
DEV void bar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
DEV void bar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}
DEV void bar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}
DEV void tma_3d(void* dst, const void* map, int c0, int c1, int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];"
      :: "r"(smem_addr(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
}
DEV void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
// K-major operand in 128-byte-swizzled rows of 128 bytes (8-row atoms of 1 KB).
DEV uint64_t sw128_desc(const void* p) {
  uint64_t d = (smem_addr(p) & 0x3FFFF) >> 4;
  d |= uint64_t(1) << 16;                 // leading byte offset (unused when swizzled)
  d |= uint64_t(1024 >> 4) << 32;         // stride byte offset: one atom
  d |= uint64_t(1) << 62;                 // 128-byte swizzle
  return d;
}
DEV void mma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
DEV void mma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
#if WAITFENCE
DEV void mma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;"); }
#else
DEV void mma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
#endif
DEV void acc_fence(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i]));
}
DEV void mma_64x128x32(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// bt_row: the run's first row (the block-table row every chunk of the run reads)
struct Seg { int first_row, n_rows, kv_len, page_lo, page_hi, item_base, bt_row, pad; };

DEV Seg load_seg(const Seg* p) {  // one segment, its fields warp-uniform
  const int4 a = __ldg(reinterpret_cast<const int4*>(p));
  const int4 b = __ldg(reinterpret_cast<const int4*>(p) + 1);
  Seg s;
  s.first_row = __shfl_sync(0xffffffffu, a.x, 0); s.n_rows = __shfl_sync(0xffffffffu, a.y, 0);
  s.kv_len = __shfl_sync(0xffffffffu, a.z, 0); s.page_lo = __shfl_sync(0xffffffffu, a.w, 0);
  s.page_hi = __shfl_sync(0xffffffffu, b.x, 0); s.item_base = __shfl_sync(0xffffffffu, b.y, 0);
  s.bt_row = s.pad = 0;  // not used by the math warpgroups
  return s;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
varlen_logits_rings(const void* __restrict__ kv_map, const void* __restrict__ q_map,
                    const uint8_t* __restrict__ kv, long long stride_block,
                    const float* __restrict__ w, int stride_w,
                    const int* __restrict__ ctx, const int* __restrict__ bt, int stride_bt,
                    float* __restrict__ out, long long stride_out,
                    const int* __restrict__ cta_segs, const Seg* __restrict__ segs) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // 1 KB alignment for the 128-byte-swizzled tiles, by pointer arithmetic on
  // the shared array (a round trip through an integer loses the address space)
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* kv_ring = smem;                                          // [RINGS][STAGES][PAGE_BYTES]
  uint8_t* q_buf = kv_ring + RINGS * STAGES * PAGE_BYTES;           // [2][GMAX][Q_GROUP_BYTES]
  float* sc_ring = reinterpret_cast<float*>(q_buf + 2 * GMAX * Q_GROUP_BYTES);  // [NUM_MATH][STAGES][PAGE]
  float* w_buf = sc_ring + RINGS * STAGES * PAGE;                   // [2][2 * GMAX][HEADS]
  float* w_perm = w_buf + 2 * 2 * GMAX * HEADS;                     // [NUM_MATH][2][GMAX][4][WPAD]
  uint64_t* full = reinterpret_cast<uint64_t*>(w_perm + NUM_MATH * 2 * GMAX * 4 * WPAD);
  uint64_t* empty = full + RINGS * STAGES;
  uint64_t* q_full = empty + RINGS * STAGES;
  uint64_t* q_empty = q_full + 2;

  // warp-uniform values broadcast from lane 0, so that the compiler sees the
  // wgmma (.sync.aligned) under warp-uniform control flow
  const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  const int warp = __shfl_sync(0xffffffffu, (threadIdx.x / 32) % 4, 0), lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int i = 0; i < RINGS * STAGES; ++i) { bar_init(&full[i], 1); bar_init(&empty[i], 4 * SPLIT); }
    for (int i = 0; i < 2; ++i) { bar_init(&q_full[i], 1); bar_init(&q_empty[i], 4 * NUM_MATH); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int seg0 = cta_segs[2 * blockIdx.x];
  const int nseg = __shfl_sync(0xffffffffu, cta_segs[2 * blockIdx.x + 1], 0);

  if (wg == 0) {  // producers: warp r's lane 0 feeds ring r; warp 0's also loads queries
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(PRODUCER_REGS));
    if (lane != 0 || warp >= RINGS) return;
    const int ring = warp;
    int j = 0;
    for (int k = 0; k < nseg; ++k) {
      const Seg s = segs[seg0 + k];
      if (ring == 0) {
        const int b = k & 1, groups = (s.n_rows + 1) / 2;
        bar_wait(&q_empty[b], ((k >> 1) & 1) ^ 1);
        bar_expect(&q_full[b], groups * Q_GROUP_BYTES + s.n_rows * HEADS * 4);
        for (int g = 0; g < groups; ++g)
          tma_3d(q_buf + (b * GMAX + g) * Q_GROUP_BYTES, q_map, 0, 0, s.first_row + 2 * g, &q_full[b]);
        bulk_copy(w_buf + b * 2 * GMAX * HEADS, w + (long long)s.first_row * stride_w,
                  s.n_rows * HEADS * 4, &q_full[b]);
      }
      const int* bt_row = bt + (long long)s.bt_row * stride_bt;
      for (int p = s.page_lo + (((ring - s.item_base) % RINGS) + RINGS) % RINGS;
           p < s.page_hi; p += RINGS, ++j) {
        const int block = __ldg(bt_row + p);
        const int slot = j % STAGES;
        bar_wait(&empty[ring * STAGES + slot], ((j / STAGES) & 1) ^ 1);
        bar_expect(&full[ring * STAGES + slot], PAGE_BYTES + PAGE * 4);
        tma_3d(kv_ring + (ring * STAGES + slot) * PAGE_BYTES, kv_map, 0, 0, block,
               &full[ring * STAGES + slot]);
        bulk_copy(sc_ring + (ring * STAGES + slot) * PAGE, kv + block * stride_block + PAGE_BYTES,
                  PAGE * 4, &full[ring * STAGES + slot]);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(MATH_REGS));
  const int ring = (wg - 1) / SPLIT, mine = (wg - 1) % SPLIT;  // groups g % SPLIT == mine
  const int t_hi = lane & 1, q_hi = (lane >> 1) & 1;   // the (token, row) this lane stores
  const int tok = warp * 16 + (lane >> 2) + 8 * t_hi;   // token in the page
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  int j = 0;
  for (int k = 0; k < nseg; ++k) {
    const Seg s = load_seg(segs + seg0 + k);
    const int b = k & 1, groups = (s.n_rows + 1) / 2;
    int lim[GMAX];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      const int r = 2 * g + q_hi;
      lim[g] = (r < s.n_rows) ? min(__ldg(ctx + s.first_row + r), s.kv_len) : 0;
    }
    bar_wait(&q_full[b], (k >> 1) & 1);
#if W128
    float* wp = w_perm + ((wg - 1) * 2 + b) * GMAX * 4 * WPAD;
    for (int i = threadIdx.x % 128; i < GMAX * 128; i += 128) {
      const int g = i / 128, t = (i / 32) % 4, jj = i % 32, n = jj / 2, e = jj % 2;
      wp[(g * 4 + t) * WPAD + jj] = w_buf[(b * GMAX + g) * 2 * HEADS + 8 * n + 2 * t + e];
    }
    asm volatile("bar.sync %0, 128;" :: "r"(wg) : "memory");
#endif
#if WSCALAR
    const float wsc = w_buf[b * GMAX * 2 * HEADS + (lane & 3)];
#endif
#if REGW
    static_assert(GMAX == SPLIT, "REGW: one row group per math warpgroup");
    float wr[32];  // this lane's weights of group `mine`, in the accumulator's column order
    {
      const float* src = w_buf + (b * GMAX + mine) * 2 * HEADS + 2 * (lane & 3);
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        const float2 v2 = *reinterpret_cast<const float2*>(src + 8 * n);
        wr[2 * n] = v2.x;
        wr[2 * n + 1] = v2.y;
      }
    }
#endif
    const int last_mine = groups - 1 - (((groups - 1 - mine) % SPLIT) + SPLIT) % SPLIT;
    for (int p = s.page_lo + (((ring - s.item_base) % RINGS) + RINGS) % RINGS;
         p < s.page_hi; p += RINGS, ++j) {
      const int slot = ring * STAGES + j % STAGES;
      bar_wait(&full[slot], (j / STAGES) & 1);
      const float scale = sc_ring[slot * PAGE + tok];
      const uint8_t* page = kv_ring + slot * PAGE_BYTES;
      const int pos = p * PAGE + tok;
      if (last_mine < 0) {  // no group of this segment is mine: hand the slot back
        __syncwarp();
        if (lane == 0) bar_arrive(&empty[slot]);
      }
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        if (g < groups && g % SPLIT == mine) {
          const uint8_t* qg = q_buf + (b * GMAX + g) * Q_GROUP_BYTES;
          mma_fence();
#pragma unroll
          for (int kk = 0; kk < DIM / 32; ++kk)
            mma_64x128x32(acc, sw128_desc(page + 32 * kk), sw128_desc(qg + 32 * kk), kk > 0);
          mma_commit();
#if PRELOAD
          float2 wpre[16];
          {
            const float* wsrc = w_buf + (b * GMAX + g) * 2 * HEADS + 2 * (lane & 3);
#pragma unroll
            for (int n = 0; n < 16; ++n) wpre[n] = *reinterpret_cast<const float2*>(wsrc + 8 * n);
          }
#endif
          mma_wait();
          acc_fence(acc);
          if (g == last_mine) {  // every read of the slot is done: hand it back
            __syncwarp();
            if (lane == 0) bar_arrive(&empty[slot]);
          }
#if NOEPI
          if (pos < 0) {  // never taken: keeps the wgmma and its wait
            float x = 0.f;
#pragma unroll
            for (int i = 0; i < 64; ++i) x += acc[i];
            out[lane] = x + lim[g] + scale;
          }
#else
          const float* wg_ = w_buf + (b * GMAX + g) * 2 * HEADS + 2 * (lane & 3);
          float s00 = 0.f, s01 = 0.f, s10 = 0.f, s11 = 0.f;   // s[token half][row]
#if W128
          float4 w4;
#endif
#pragma unroll
          for (int n = 0; n < 16; ++n) {
#if CONSTW
            const float2 wv = make_float2(0.5f + n, 0.25f - n);
#elif PRELOAD
            const float2 wv = wpre[n];
#elif WSCALAR
            const float2 wv = make_float2(wsc, wsc);
#elif W128
            float2 wv;
            if (n % 2 == 0) {
              w4 = *reinterpret_cast<const float4*>(wp + (g * 4 + (lane & 3)) * WPAD + 2 * n);
              wv = make_float2(w4.x, w4.y);
            } else {
              wv = make_float2(w4.z, w4.w);
            }
#elif REGW
            const float2 wv = make_float2(wr[2 * n], wr[2 * n + 1]);
#else
            const float2 wv = *reinterpret_cast<const float2*>(wg_ + 8 * n);
#endif
            const float a0 = fmaxf(acc[4 * n + 0], 0.f), a1 = fmaxf(acc[4 * n + 1], 0.f);
            const float a2 = fmaxf(acc[4 * n + 2], 0.f), a3 = fmaxf(acc[4 * n + 3], 0.f);
            if (n < 8) { s00 = fmaf(a0, wv.x, s00); s00 = fmaf(a1, wv.y, s00);
                         s10 = fmaf(a2, wv.x, s10); s10 = fmaf(a3, wv.y, s10); }
            else       { s01 = fmaf(a0, wv.x, s01); s01 = fmaf(a1, wv.y, s01);
                         s11 = fmaf(a2, wv.x, s11); s11 = fmaf(a3, wv.y, s11); }
          }
          // sum over the 4 lanes of a quad, each lane ending with one (token, row)
          float k0 = t_hi ? s10 : s00, k1 = t_hi ? s11 : s01;
          const float o0 = t_hi ? s00 : s10, o1 = t_hi ? s01 : s11;
          k0 += __shfl_xor_sync(0xffffffffu, o0, 1);
          k1 += __shfl_xor_sync(0xffffffffu, o1, 1);
          float v = q_hi ? k1 : k0;
          v += __shfl_xor_sync(0xffffffffu, q_hi ? k0 : k1, 2);
#if NOSTORE
          if (pos < lim[g] && v == 1.17e-37f)
#else
          if (pos < lim[g])
#endif
            out[(long long)(s.first_row + 2 * g + q_hi) * stride_out + pos] = v * scale;
#endif
        }
      }
    }
    __syncwarp();
    if (lane == 0) bar_arrive(&q_empty[b]);
  }
}
