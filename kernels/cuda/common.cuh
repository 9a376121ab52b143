// Device helpers and the split combine (kernel and launch) shared by decode_attention.cu
// (int4, fp8, KIVI) and hqmq_decode.cu: included by both, each built into its own library
// (kernels/cuda_decode.py `compile_library` hashes this header with the source).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace {

constexpr uint32_t MAGIC_LO = 0x64006400u;  // fp16 1024 in both halves: mantissa bit 0 weighs 1
constexpr uint32_t MAGIC_HI = 0x54005400u;  // fp16 64: mantissa bit 4 weighs 1
#define NEG_INF (-__int_as_float(0x7f800000))  // -inf (a device intrinsic, not constexpr)

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  uint32_t d;  // cvt.rn.f16x2.f32 d, a, b puts a in the upper half
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
__device__ __forceinline__ uint32_t movtrans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// N bytes global -> shared, asynchronously (cp_commit / cp_wait); !ok: zeros (src-size
// 0: nothing is read, so a pointer past the valid rows is safe)
template <int N>
__device__ __forceinline__ void cp_async(uint32_t dst, const void* src, bool ok) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
  if constexpr (N == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(N), "r"(ok ? N : 0)
                 : "memory");
}

// The nibbles at bits 0-3 and 16-19 (HI: 4-7, 20-23) of x, each in the mantissa of an
// fp16 MAGIC (1024 + x, HI: 64 + x): (x & MASK) | MAGIC in ONE lop3 (C code gives an AND
// and an OR). Minus the magic (an HSUB2, each kernel's own way) that is the exact half2.
template <bool HI>
__device__ __forceinline__ uint32_t nibbles_magic(uint32_t x) {
  uint32_t d;
  if constexpr (HI) asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(x), "n"(0x00F000F0u), "n"(MAGIC_HI));
  else asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(x), "n"(0x000F000Fu), "n"(MAGIC_LO));
  return d;
}

// Online softmax over one 16-token tile (log2 domain). s: the scores of heads 2c, 2c+1 (e)
// for tile rows g (s[e]) and g+8 (s[2+e]); m, l: the running max and sum per head; acc:
// O^T fragments, rescaled when a max grows; p0..p3: the tile's weights (as s), relative to
// the new max. The max over the 16 tokens is over g (the lanes of equal c).
// The max is reduced lazily: a lane first compares its own two tokens with the running max
// (equal across the lanes of a head), and only when some lane's beat it (one vote; rare after
// the first tiles) are the maxima reduced and the sums rescaled. Bit for bit the eager
// reduction's result (max is exact, so "some lane beat m" is "the tile's max beat m"), without
// its 6 shuffles per tile in the common case: the shuffles queue on the MIO pipe with the
// shared loads, which bound the kernels (reports/kernels/NOTES.md, the d 64 profile). H100,
// B=8 T=32k graphed, against the eager reduction in the same call (gpu_ab.sh): HQMQ d 128 -2.5%,
// Med3x -1.9%, HQMQ d 64 -2.6%, KIVI-2 -0.7%, int4 / fp8 / KIVI-4 within 0.3%
// (reports/latency/lazy_max_ab_h100_2026-12-06/). Offline it cost 1-11 registers in some
// instances; the non-default KIVI d 128 variants 2 / 3 (128-register cap) spill 8-28 bytes.
// A split kernel's running state per q-head half (HH: halves a CTA takes; 2 for a GQA group of
// 16 in one CTA): O^T at 0, maxima at -inf, sums at 0
template <int HH, int KS>
__device__ __forceinline__ void zero_halves(float (&acc)[HH][KS][4], float (&m)[HH][2], float (&l)[HH][2]) {
#pragma unroll
  for (int hh = 0; hh < HH; ++hh) {
#pragma unroll
    for (int i = 0; i < KS; ++i) acc[hh][i][0] = acc[hh][i][1] = acc[hh][i][2] = acc[hh][i][3] = 0.f;
    m[hh][0] = m[hh][1] = NEG_INF;
    l[hh][0] = l[hh][1] = 0.f;
  }
}

template <int KS>
__device__ __forceinline__ void online_softmax(const float (&s)[4], float (&m)[2], float (&l)[2], float (&acc)[KS][4],
                                               float& p0, float& p1, float& p2, float& p3) {
  float mx[2] = {fmaxf(s[0], s[2]), fmaxf(s[1], s[3])};
  if (__any_sync(0xffffffffu, mx[0] > m[0] || mx[1] > m[1])) {  // some max grew: reduce it, rescale
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], o));
    }
    float alpha[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float mn = fmaxf(m[e], mx[e]);
      alpha[e] = (mn == NEG_INF) ? 1.f : exp2f(m[e] - mn);
      m[e] = mn;
      l[e] *= alpha[e];
    }
#pragma unroll
    for (int i = 0; i < KS; ++i) {
      acc[i][0] *= alpha[0]; acc[i][1] *= alpha[1]; acc[i][2] *= alpha[0]; acc[i][3] *= alpha[1];
    }
  }
  const float ms0 = m[0] == NEG_INF ? 0.f : m[0], ms1 = m[1] == NEG_INF ? 0.f : m[1];
  p0 = exp2f(s[0] - ms0); p1 = exp2f(s[1] - ms1); p2 = exp2f(s[2] - ms0); p3 = exp2f(s[3] - ms1);
  l[0] += p0 + p2;
  l[1] += p1 + p3;
}

// Head dim 256 by warp pairs (hqmq_decode.cu, decode_attention.cu): each warp of a pair
// scores the tile over its half of the dims, and the pair adds its two partial scores
// here before the softmax. xb: this tile's exchange buffer of the pair, [half][lane] in
// 16-byte (pair_add) or 32-byte (pair_add2: two tiles' scores) slots, double-buffered by the
// caller, so one named barrier (bar, 64 threads) a tile suffices: a warp writes a buffer
// again two tiles later, after its partner has passed the barrier of the tile between, that
// is after its read. Both warps get the same sums (a + b == b + a).
__device__ __forceinline__ void pair_add(float (&s)[4], uint8_t* xb, int hf, int lane, int bar) {
  *reinterpret_cast<float4*>(xb + 512 * hf + 16 * lane) = make_float4(s[0], s[1], s[2], s[3]);
  asm volatile("bar.sync %0, 64;" ::"r"(bar) : "memory");
  const float4 o = *reinterpret_cast<const float4*>(xb + 512 * (hf ^ 1) + 16 * lane);
  s[0] += o.x;
  s[1] += o.y;
  s[2] += o.z;
  s[3] += o.w;
}
__device__ __forceinline__ void pair_add2(float (&s0)[4], float (&s1)[4], uint8_t* xb, int hf, int lane, int bar) {
  float4* mine = reinterpret_cast<float4*>(xb + 1024 * hf + 32 * lane);
  mine[0] = make_float4(s0[0], s0[1], s0[2], s0[3]);
  mine[1] = make_float4(s1[0], s1[1], s1[2], s1[3]);
  asm volatile("bar.sync %0, 64;" ::"r"(bar) : "memory");
  const float4* other = reinterpret_cast<const float4*>(xb + 1024 * (hf ^ 1) + 32 * lane);
  const float4 o0 = other[0], o1 = other[1];
  s0[0] += o0.x; s0[1] += o0.y; s0[2] += o0.z; s0[3] += o0.w;
  s1[0] += o1.x; s1[1] += o1.y; s1[2] += o1.z; s1[3] += o1.w;
}

// One split's term of the combine and the row's result: combine_kernel and the fused
// last-CTA combine (combine_rows) both add through these, in the same order, so the two paths
// give the same bits (the GPU tests compare them bit for bit).
__device__ __forceinline__ float combine_weight(float ms, float M) { return (ms == NEG_INF) ? 0.f : exp2f(ms - M); }
__device__ __forceinline__ void combine_add(float& acc, float w, float x) { acc += w * x; }
template <typename OutT>
__device__ __forceinline__ void combine_store(OutT* out, long long i, float num, float den) {
  const float o = num / den;
  if constexpr (sizeof(OutT) == 4) out[i] = o;
  else if constexpr (std::is_same<OutT, __half>::value) out[i] = __float2half_rn(o);
  else {  // bf16 bits, round to nearest even
    const uint32_t u = __float_as_uint(o);
    out[i] = (OutT)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}

// Programmatic dependent launch (sm_90+; library.py `PDL`): with `pdl_on` set, the combine is
// launched with programmatic stream serialization, so the GPU may start it before the split
// kernel has finished: every split CTA triggers its dependents as it starts (pdl_trigger), so
// once the last wave of split CTAs is resident the combine's CTAs are launched into the slots
// that the exiting split CTAs free, and each waits (pdl_wait) until the split grid has
// completed and its partials are visible, then reads them. What it removes is the gap between
// the two kernels (launch and ramp); the arithmetic and its order are unchanged, so the
// result is the same bits. Without the attribute (pdl_on 0, or below sm_90) both
// instructions do nothing.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
int pdl_on = 0;  // (the namespace is anonymous: one flag per library; set by its kvq_*set_pdl entry)

// Merge the nsplit partials of each query row: one CTA per row, PARTS x D threads;
// thread (part, d) sums the splits part, part + PARTS, ... (unrolled: many loads in
// flight), then the parts are added in shared memory. GPU run 13: B=1 took 53 / 83 /
// 147 us at 132 / 264 / 528 splits (~0.23 us per split), which points at the first
// version (one thread per dim walking every split, one dependent round trip each).
constexpr int COMBINE_THREADS = 512;
constexpr int COMBINE_HELD = 10;  // splits a thread loads before the max (at d 128: all of 40 splits)
template <typename OutT>
__global__ void __launch_bounds__(COMBINE_THREADS, 2) combine_kernel(const float* __restrict__ po,
                                                                  const float* __restrict__ pm,
                                                                  const float* __restrict__ pl, OutT* __restrict__ out,
                                                                  int nsplit, int D) {
  __shared__ float wmax[COMBINE_THREADS / 32];
  __shared__ float part_num[COMBINE_THREADS], part_den[COMBINE_THREADS];
  const long long row = blockIdx.x;
  const int tid = threadIdx.x, parts = blockDim.x / D;
  const int d = tid % D, part = tid / D;
  const float* pmr = pm + row * nsplit;
  const float* plr = pl + row * nsplit;
  const float* por = po + row * nsplit * D + d;
  pdl_wait();  // (the split grid's partials, when launched as its programmatic dependent)
  // This thread's first COMBINE_HELD splits (s = part, part + parts, ...) are loaded before the max is
  // known, so their L2 round trip overlaps the max's loads and reduction instead of following
  // it; the sums below take them in the same order as the loop after them takes the rest (the
  // same bits). Graphed A/B on an H100: 0.5-1 us of a B=8 call (reports/latency/h100_2026-12-07/).
  float held_m[COMBINE_HELD], held_l[COMBINE_HELD], held_o[COMBINE_HELD];
#pragma unroll
  for (int i = 0; i < COMBINE_HELD; ++i) {
    const int s = part + i * parts;
    if (s < nsplit) {
      held_m[i] = pmr[s];
      held_l[i] = plr[s];
      held_o[i] = por[(long long)s * D];
    }
  }
  float M = NEG_INF;
  for (int s = tid; s < nsplit; s += blockDim.x) M = fmaxf(M, pmr[s]);
#pragma unroll
  for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  if ((tid & 31) == 0) wmax[tid >> 5] = M;
  __syncthreads();
  M = wmax[0];
  for (int i = 1; i < (int)(blockDim.x >> 5); ++i) M = fmaxf(M, wmax[i]);
  float num = 0.f, den = 0.f;
#pragma unroll
  for (int i = 0; i < COMBINE_HELD; ++i) {
    if (part + i * parts < nsplit) {
      const float w = combine_weight(held_m[i], M);
      combine_add(den, w, held_l[i]);
      combine_add(num, w, held_o[i]);
    }
  }
#pragma unroll 4
  for (int s = part + COMBINE_HELD * parts; s < nsplit; s += parts) {
    const float w = combine_weight(pmr[s], M);
    combine_add(den, w, plr[s]);
    combine_add(num, w, por[(long long)s * D]);
  }
  part_num[tid] = num;
  part_den[tid] = den;
  __syncthreads();
  if (part) return;
  for (int i = 1; i < parts; ++i) {
    num += part_num[i * D + d];
    den += part_den[i * D + d];
  }
  combine_store(out, row * D + d, num, den);
}

// The combine launch of a call: rows_q query rows of D dims, out in otype (0 fp16, 1 bf16
// bits, 2 fp32); with pdl_on, as the split kernel's programmatic dependent. Returns a cudaError_t.
template <typename OutT>
int launch_combine_t(const float* po, const float* pm, const float* pl, OutT* out, int rows_q, int nsplit, int D,
                     int threads, cudaStream_t stream) {
  if (!pdl_on) {
    combine_kernel<OutT><<<rows_q, threads, 0, stream>>>(po, pm, pl, out, nsplit, D);
    return (int)cudaGetLastError();
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(rows_q);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&cfg, combine_kernel<OutT>, po, pm, pl, out, nsplit, D);
}
template <int D>
int launch_combine(const float* po, const float* pm, const float* pl, void* out, int otype, int rows_q, int nsplit,
                   cudaStream_t stream) {
  const int threads = (COMBINE_THREADS / D) * D;
  if (otype == 0) return launch_combine_t(po, pm, pl, (__half*)out, rows_q, nsplit, D, threads, stream);
  if (otype == 1) return launch_combine_t(po, pm, pl, (uint16_t*)out, rows_q, nsplit, D, threads, stream);
  return launch_combine_t(po, pm, pl, (float*)out, rows_q, nsplit, D, threads, stream);
}

// ---------------------------------------------------------------------------------
// The fused combine (the FUSED instances of the split kernels; library.py FUSED_COMBINE):
// no second launch. The CTAs of one row group (one (b, kv head): its gqa query rows, nsplit
// CTAs) count themselves in on an int32 counter of the call's own (library.py: one per
// workspace / scratch buffer, zeroed when allocated); the last CTA to arrive merges the
// group's partials as combine_kernel would and writes `out`, and sets the counter back to 0
// (every CTA of the group has counted by then), so the next launch finds it zero without a
// memset. A CUDA graph replays the same: each replay leaves the counters at 0.
// ---------------------------------------------------------------------------------

// After a CTA's partial stores (every thread of the CTA calls it): whether this CTA is the
// last of its group's nsplit to get here (the same answer in every thread). Each thread
// fences its own stores (device scope) before the barrier, one thread counts the CTA in, and
// the last CTA fences again before it reads the others' partials (combine_rows reads them
// through L2: ld.global.cg). nsplit == 1: the only CTA, the counter untouched.
__device__ __forceinline__ bool last_of_group(int* counter, int nsplit) {
  if (nsplit == 1) {
    __syncthreads();  // (the CTA's own partial stores, visible to its threads)
    return true;
  }
  __threadfence();
  __syncthreads();
  int last = 0;
  if (threadIdx.x == 0) {
    last = atomicAdd(counter, 1) == nsplit - 1;
    if (last) atomicExch(counter, 0);
  }
  last = __syncthreads_or(last);
  if (last) __threadfence();
  return last != 0;
}

// The combine of query rows [row0, row0 + nrows) by one CTA (every thread calls it; smax:
// nrows floats of shared memory, free to overwrite), bit for bit combine_kernel's: there,
// thread (part, d) of PARTS = COMBINE_THREADS / D sums the splits s = part, part + PARTS, ...
// in order and part 0 then adds the parts' sums in order; here a thread keeps the PARTS sums
// of 4 dims side by side (independent chains: a stride of PARTS splits' loads in flight
// together, float4 loads of po) and adds them in that same order.
template <int D, typename OutT>
__device__ __forceinline__ void combine_rows_t(const float* po, const float* pm, const float* pl, OutT* out,
                                               long long row0, int nrows, int nsplit, const float* smax) {
  constexpr int PARTS = COMBINE_THREADS / D, Q = D / 4;
  for (int it = threadIdx.x; it < nrows * Q; it += blockDim.x) {
    const int r = it / Q, d0 = 4 * (it % Q);
    const long long row = row0 + r;
    const float* pmr = pm + row * nsplit;
    const float* plr = pl + row * nsplit;
    const float* por = po + row * nsplit * D + d0;
    const float M = smax[r];
    float num[PARTS][4], den[PARTS];
#pragma unroll
    for (int i = 0; i < PARTS; ++i) den[i] = num[i][0] = num[i][1] = num[i][2] = num[i][3] = 0.f;
#pragma unroll 2
    for (int s0 = 0; s0 < nsplit; s0 += PARTS) {
#pragma unroll
      for (int i = 0; i < PARTS; ++i) {
        const int s = s0 + i;
        if (s < nsplit) {
          const float w = combine_weight(__ldcg(pmr + s), M);
          combine_add(den[i], w, __ldcg(plr + s));
          const float4 x = __ldcg(reinterpret_cast<const float4*>(por + (long long)s * D));
          combine_add(num[i][0], w, x.x);
          combine_add(num[i][1], w, x.y);
          combine_add(num[i][2], w, x.z);
          combine_add(num[i][3], w, x.w);
        }
      }
    }
#pragma unroll
    for (int i = 1; i < PARTS; ++i) {
      den[0] += den[i];
#pragma unroll
      for (int j = 0; j < 4; ++j) num[0][j] += num[i][j];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) combine_store(out, row * D + d0 + j, num[0][j], den[0]);
  }
}
template <int D>
__device__ __forceinline__ void combine_rows(const float* po, const float* pm, const float* pl, void* out, int otype,
                                             long long row0, int nrows, int nsplit, float* smax) {
  const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  for (int r = threadIdx.x >> 5; r < nrows; r += nw) {  // each row's max over its splits (a warp a row)
    const float* pmr = pm + (row0 + r) * nsplit;
    float M = NEG_INF;
    for (int s = lane; s < nsplit; s += 32) M = fmaxf(M, __ldcg(pmr + s));
#pragma unroll
    for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    if (lane == 0) smax[r] = M;
  }
  __syncthreads();
  if (otype == 0) combine_rows_t<D>(po, pm, pl, (__half*)out, row0, nrows, nsplit, smax);
  else if (otype == 1) combine_rows_t<D>(po, pm, pl, (uint16_t*)out, row0, nrows, nsplit, smax);
  else combine_rows_t<D>(po, pm, pl, (float*)out, row0, nrows, nsplit, smax);
}

}  // namespace
