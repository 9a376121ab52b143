// Fused split-K decode attention over HQMQ caches (S secondaries with 12-bit codes,
// r=4 uniform radius levels, head_dim 128; no Med3x outliers), CUDA C++ with mma.sync
// from registers. Built at first use by kernels/cuda_hqmq.py (nvcc -> a shared library
// called through ctypes). kernels/NOTES.md ("CUDA HQMQ decode") has the design and the
// figures.
//
// Same skeleton as kernels/cuda/decode_attention.cu (int4/fp8), written separately so
// that file can change under another engineer; the small helpers below (mma, movmatrix,
// cp.async, nibble LOP3, combine kernel) DUPLICATE that file's: a later refactor should
// move them into a shared header.
//
// One CTA of NW warps per (b * Hkv + h, split). The CTA first copies the kv head's two
// codebooks (K and V, [24 S, 4] fp16 = 192 S bytes each, 18 KB at S=96) into shared
// memory; every chunk of 4 dims is then ONE 8-byte LDS gather table[code] (two half2),
// times its radius code rq (0..15, exact in fp16 by the magic-number trick: one LOP3 +
// one HSUB2 per two chunks): one rounding of cw * rq. The token's r_max / 15 is applied
// in fp32 outside the mma: K to the scores (s_t = r_max_t / 15 sum_c rq <q_c, cw_c>),
// V to P (p_t r_max_t / 15, then rounded to fp16 as P is anyway). GPU run 1 (NOTES.md)
// rounded rhat = rq * round16(r_max / 15) into the decode as Triton does: ~3e-3 relative
// output error at the tolerance's edge, and 16 more HMUL2 per tile.
// Each warp streams its 16-token tiles through SMS cp.async stages (K and V codes 48 B
// per token, radius 16 B per token, and a 16-byte-aligned 48-byte window of r_max).
//
// Tokens on the mma M axis, GQA heads (<= 8) on N (as the int4 kernel):
//   S^T[16 tok, 8] = K[16 tok, 128] Q^T     (A = K: lane (g, c) owns chunks 8c..8c+7 of
//                                            tokens g, g+8; chunk 8c+kk feeds k-step kk:
//                                            dims 0,1 -> k 2c,2c+1; dims 2,3 -> k 2c+8,2c+9;
//                                            Q loaded in the same permuted order)
//   O^T[128, 8] += V^T[128, 16 tok] P^T      (A = V^T: lane g owns chunks 4g..4g+3 of
//                                            tokens 2c, 2c+1, 2c+8, 2c+9; the two tokens'
//                                            gathered codewords are interleaved by PRMT
//                                            into (t, t+1) pairs of one dim)
// so per chunk: 2 address ops (SHF/LOP3), 1 LDS.64, 2 HMUL2 (+2 PRMT for V), and the
// radius code (~1 per chunk); an HMMA per 2 chunks.

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "common.cuh"

namespace {


constexpr int D = 128;
constexpr int NC = D / 4;     // chunks per token
constexpr int CB = NC * 12 / 8;  // code bytes per token (48)
constexpr int RB = NC * 4 / 8;   // radius bytes per token (16)
constexpr int KS = D / 16;       // k-steps of QK^T = m-tiles of PV

struct Params {
  const void* q;  // [B, Hq, 1, D], qtype 0 fp16, 1 bf16, 2 fp32
  const uint8_t* kc;  // codes [B, Hkv, Tcap, 48]
  const uint8_t* kr;  // radius codes [B, Hkv, Tcap, 16]
  const uint16_t* km;  // r_max [B, Hkv, Tcap] fp16 bits
  const uint8_t* vc;
  const uint8_t* vr;
  const uint16_t* vm;
  const uint16_t* ktab;  // [Hkv, 24 S, 4] fp16 codebook of K
  const uint16_t* vtab;
  long long k_cs, k_rs, k_ms, v_cs, v_rs, v_ms;  // per-(b, h) strides in elements
  const int* vlen;  // device-side valid length (nullptr: T); T is then the capacity bound
  int qtype, T, Hkv, gqa, steps_per_split, nsplit, tab_bytes;  // tab_bytes = 192 S
  float qk_scale;
  float* po;
  float* pm;
  float* pl;
};

// ---------------------------------------------------------------------------------
// helpers (duplicated from decode_attention.cu; see the header)
// ---------------------------------------------------------------------------------
__device__ __forceinline__ __half2 h2(uint32_t u) {
  __half2 h;
  memcpy(&h, &u, 4);
  return h;
}
__device__ __forceinline__ uint32_t u32(__half2 h) {
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}
// nibbles at bits 0-3 and 16-19 (HI: 4-7, 20-23) of x as an exact half2: one LOP3 + HSUB2
template <bool HI>
__device__ __forceinline__ __half2 nibbles(uint32_t x) {
  uint32_t d;
  if constexpr (HI) asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(x), "n"(0x00F000F0u), "n"(MAGIC_HI));
  else asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(x), "n"(0x000F000Fu), "n"(MAGIC_LO));
  return __hsub2(h2(d), h2(HI ? MAGIC_HI : MAGIC_LO));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

// fp16 r_max bits -> r_max / 15 in fp32 (rounded to fp16 by the caller, as the Triton kernel does)
__device__ __forceinline__ float rm15(uint32_t bits) {
  return __half2float(__ushort_as_half((unsigned short)bits)) * (1.f / 15.f);  // within an fp32 ulp of the quotient
}

// ---------------------------------------------------------------------------------
// one warp stage: the bytes of a 16-token tile
// ---------------------------------------------------------------------------------
struct Stage {
  static constexpr int KC = 0, VC = 16 * CB, KR = 2 * 16 * CB, VR = KR + 16 * RB, KM = VR + 16 * RB, VM = KM + 48;
  static constexpr int BYTES = VM + 48;  // 2144
};

// A lane's global source pointers for its copies of the next tile (advanced by warp strides).
struct CpCursor {
  const uint8_t* c0;  // codes chunk `lane` (K for lanes 0..31), chunk lane + 32 (lanes 0..15)
  const uint8_t* vc0;
  const uint8_t* r;   // radius row lane & 15: K (lanes 0..15) or V (16..31)
  const uint8_t* m;   // r_max window granule (lanes 0..2 K, 3..5 V)
  const uint8_t* mlast;  // last valid r_max byte of this lane's tensor (the window is read only up to it)
  int t0;
};

template <int NW>
__device__ __forceinline__ void copy_tile(uint32_t st, CpCursor& cur, int T, bool on, int lane) {
  constexpr int STEP = NW * 16;
  {
    const int i = lane;  // code chunk i: token i / 3
    const bool ok = on && cur.t0 + i / 3 < T;
    cp_async16(st + Stage::KC + 16 * i, cur.c0, ok);
    cp_async16(st + Stage::VC + 16 * i, cur.vc0, ok);
  }
  if (lane < 16) {
    const int i = lane + 32;
    const bool ok = on && cur.t0 + i / 3 < T;
    cp_async16(st + Stage::KC + 16 * i, cur.c0 + 512, ok);
    cp_async16(st + Stage::VC + 16 * i, cur.vc0 + 512, ok);
  }
  {
    const bool ok = on && cur.t0 + (lane & 15) < T;
    cp_async16(st + (lane < 16 ? Stage::KR : Stage::VR) + 16 * (lane & 15), cur.r, ok);
  }
  if (lane < 6) {
    // granule (lane % 3) of the 16-byte-aligned window over this tile's r_max: copied only
    // if it holds a valid token's byte (so it lies inside the allocation)
    const bool ok = on && cur.m <= cur.mlast;
    cp_async16(st + (lane < 3 ? Stage::KM : Stage::VM) + 16 * (lane % 3), cur.m, ok);
  }
  cur.t0 += STEP;
  cur.c0 += STEP * CB;
  cur.vc0 += STEP * CB;
  cur.r += STEP * RB;
  cur.m += STEP * 2;
}

// ---------------------------------------------------------------------------------
// the tile: K decode + scores, online softmax, V decode + PV
// ---------------------------------------------------------------------------------
template <typename QT>
__device__ __forceinline__ void load_q(const QT* q, long long row, bool real, int c, uint32_t (&qb)[KS][2]) {
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
    for (int slot = 0; slot < 2; ++slot) {
      float x[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = 4 * (8 * c + kk) + 2 * slot + half;
        float v = 0.f;
        if (real) {
          if constexpr (std::is_same<QT, float>::value) v = q[row * D + d];
          else if constexpr (std::is_same<QT, __half>::value) v = __half2float(q[row * D + d]);
          else v = __uint_as_float((uint32_t)q[row * D + d] << 16);  // bf16 bits
        }
        x[half] = v;
      }
      qb[kk][slot] = pack_half2(x[0], x[1]);
    }
  }
}

// code kk (0..7) of the 96-bit little-endian stream w0 w1 w2, times 8 (a byte offset into the table)
template <int KK>
__device__ __forceinline__ uint32_t code8(uint32_t w0, uint32_t w1, uint32_t w2) {
  // shifted right by (bit % 32) - 3, so the code lands at bits 3..14: one SHF + one LOP3
  constexpr int bit = 12 * KK, wi = bit / 32, sh = bit % 32;
  const uint32_t lo = wi == 0 ? w0 : (wi == 1 ? w1 : w2);
  const uint32_t hi = wi == 0 ? w1 : w2;
  uint32_t x;
  if constexpr (sh < 3) x = lo << (3 - sh);
  else if constexpr (sh + 12 > 32) x = __funnelshift_r(lo, hi, sh - 3);
  else x = lo >> (sh - 3);
  return x & 0x7FF8u;
}

__device__ __forceinline__ uint2 gather(const uint8_t* tab, uint32_t off) {
  return *reinterpret_cast<const uint2*>(tab + off);
}

__device__ __forceinline__ void tile_step(const uint8_t* st, const uint8_t* ktab, const uint8_t* vtab, int moff_k,
                                          int moff_v, int t0, int T, float qk, const uint32_t (&qb)[KS][2],
                                          float (&acc)[KS][4], float (&m)[2], float (&l)[2], int g, int c) {
  // ---- K: tokens g, g+8; chunks 8c .. 8c+7
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  float rk[2];
  {
    uint32_t w[2][3], rw[2], rmb[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int t = g + 8 * i;
      const uint8_t* row = st + Stage::KC + t * CB + 12 * c;
      w[i][0] = *reinterpret_cast<const uint32_t*>(row);
      w[i][1] = *reinterpret_cast<const uint32_t*>(row + 4);
      w[i][2] = *reinterpret_cast<const uint32_t*>(row + 8);
      rw[i] = *reinterpret_cast<const uint32_t*>(st + Stage::KR + t * RB + 4 * c);
      rmb[i] = *reinterpret_cast<const uint16_t*>(st + Stage::KM + moff_k + 2 * t);
    }
    rk[0] = rm15(rmb[0]);  // r_max / 15 of tokens g, g+8 in fp32: applied to the fp32 scores
    rk[1] = rm15(rmb[1]);
    const uint32_t rlo = __byte_perm(rw[0], rw[1], 0x5410);  // chunks 0-3 of g, g+8
    const uint32_t rhi = __byte_perm(rw[0], rw[1], 0x7632);  // chunks 4-7
    uint32_t off[2][8];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      off[i][0] = code8<0>(w[i][0], w[i][1], w[i][2]);
      off[i][1] = code8<1>(w[i][0], w[i][1], w[i][2]);
      off[i][2] = code8<2>(w[i][0], w[i][1], w[i][2]);
      off[i][3] = code8<3>(w[i][0], w[i][1], w[i][2]);
      off[i][4] = code8<4>(w[i][0], w[i][1], w[i][2]);
      off[i][5] = code8<5>(w[i][0], w[i][1], w[i][2]);
      off[i][6] = code8<6>(w[i][0], w[i][1], w[i][2]);
      off[i][7] = code8<7>(w[i][0], w[i][1], w[i][2]);
    }
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      uint32_t x = kk < 4 ? rlo : rhi;
      if (kk & 2) x >>= 8;
      const __half2 rh = (kk & 1) ? nibbles<true>(x) : nibbles<false>(x);  // (rq of token g, of g+8), exact
      const uint2 cg = gather(ktab, off[0][kk]);
      const uint2 cg8 = gather(ktab, off[1][kk]);
      const __half2 rg = __low2half2(rh), rg8 = __high2half2(rh);
      mma16816(s, u32(__hmul2(h2(cg.x), rg)), u32(__hmul2(h2(cg8.x), rg8)), u32(__hmul2(h2(cg.y), rg)),
               u32(__hmul2(h2(cg8.y), rg8)), qb[kk][0], qb[kk][1]);
    }
  }
  s[0] *= qk * rk[0]; s[1] *= qk * rk[0]; s[2] *= qk * rk[1]; s[3] *= qk * rk[1];
  if (t0 + g >= T) s[0] = s[1] = NEG_INF;
  if (t0 + g + 8 >= T) s[2] = s[3] = NEG_INF;

  // ---- online softmax per head (2c + e): common.cuh
  float p0, p1, p2, p3;
  online_softmax<KS>(s, m, l, acc, p0, p1, p2, p3);
  // V's r_max / 15 folded into P (v_t = (r_max_t / 15) rq cw): P^T carries p_t r_max_t / 15;
  // zero past T, so no garbage r_max of the capacity reaches the sums
  const float rv0 = t0 + g < T ? rm15(*reinterpret_cast<const uint16_t*>(st + Stage::VM + moff_v + 2 * g)) : 0.f;
  const float rv1 =
      t0 + g + 8 < T ? rm15(*reinterpret_cast<const uint16_t*>(st + Stage::VM + moff_v + 2 * (g + 8))) : 0.f;
  const uint32_t pb0 = movtrans(pack_half2(p0 * rv0, p1 * rv0));  // P^T: k = tokens 2c, 2c+1; n = head g
  const uint32_t pb1 = movtrans(pack_half2(p2 * rv1, p3 * rv1));  //      k = tokens 2c+8, 2c+9

  // ---- V: tokens 2c, 2c+1 (pair 0), 2c+8, 2c+9 (pair 1); chunks 4g .. 4g+3
  const int sh = 16 * (g & 1);
  const int wo = 4 * ((3 * g) >> 1);  // byte of the word holding bit 48 g of the row
  uint32_t off[4][4];  // [token 2c, 2c+1, 2c+8, 2c+9][chunk jj] table byte offsets
  uint32_t rb[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int t = 2 * c + (j & 1) + 8 * (j >> 1);
    const uint8_t* row = st + Stage::VC + t * CB + wo;
    const uint32_t w0 = *reinterpret_cast<const uint32_t*>(row), w1 = *reinterpret_cast<const uint32_t*>(row + 4);
    const uint32_t lo = __funnelshift_r(w0, w1, sh), hi = w1 >> sh;  // bits 48g .. 48g+47 of the row
    off[j][0] = (lo << 3) & 0x7FF8u;  // code * 8: a byte offset into the table
    off[j][1] = (lo >> 9) & 0x7FF8u;
    off[j][2] = __funnelshift_r(lo, hi, 21) & 0x7FF8u;
    off[j][3] = (hi >> 1) & 0x7FF8u;
    rb[j] = *reinterpret_cast<const uint16_t*>(st + Stage::VR + t * RB + 2 * g);
  }
  const uint32_t u01 = __byte_perm(rb[0], rb[1], 0x5410), u89 = __byte_perm(rb[2], rb[3], 0x5410);  // t.b0 t.b1 t1.b0 t1.b1
  // chunk jj of the lane = m-tiles 2 jj (dims 4jj, 4jj+1 = rows g, g+8) and 2 jj + 1 (dims 4jj+2, +3):
  // dim 16 g + 2 mt + row, as the merge below expects
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    const uint32_t x01 = (jj & 2) ? (u01 >> 8) : u01, x89 = (jj & 2) ? (u89 >> 8) : u89;
    const __half2 r01 = (jj & 1) ? nibbles<true>(x01) : nibbles<false>(x01);  // (rq_2c, rq_2c+1), exact
    const __half2 r89 = (jj & 1) ? nibbles<true>(x89) : nibbles<false>(x89);
    const uint2 c0 = gather(vtab, off[0][jj]), c1 = gather(vtab, off[1][jj]);
    const uint2 c8 = gather(vtab, off[2][jj]), c9 = gather(vtab, off[3][jj]);
    mma16816(acc[2 * jj], u32(__hmul2(h2(__byte_perm(c0.x, c1.x, 0x5410)), r01)),
             u32(__hmul2(h2(__byte_perm(c0.x, c1.x, 0x7632)), r01)),
             u32(__hmul2(h2(__byte_perm(c8.x, c9.x, 0x5410)), r89)),
             u32(__hmul2(h2(__byte_perm(c8.x, c9.x, 0x7632)), r89)), pb0, pb1);
    mma16816(acc[2 * jj + 1], u32(__hmul2(h2(__byte_perm(c0.y, c1.y, 0x5410)), r01)),
             u32(__hmul2(h2(__byte_perm(c0.y, c1.y, 0x7632)), r01)),
             u32(__hmul2(h2(__byte_perm(c8.y, c9.y, 0x5410)), r89)),
             u32(__hmul2(h2(__byte_perm(c8.y, c9.y, 0x7632)), r89)), pb0, pb1);
  }
}

template <int NW, int SMS, int TABB>
constexpr int dyn_smem() {
  constexpr int body = 2 * TABB + SMS * NW * Stage::BYTES;
  constexpr int red = NW * 8 * D * 4;
  return body > red ? body : red;
}

// TABB: bytes reserved per codebook (>= 192 S): the V table sits at a compile-time offset,
// so both gathers are [reg + immediate] LDS.64.
template <int NW, int SMS, int TABB, int MINB>
__global__ void __launch_bounds__(NW * 32, MINB) hqmq_split_kernel(const Params p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int bh = blockIdx.x, sp = blockIdx.y;
  const int h = bh % p.Hkv;
  extern __shared__ __align__(16) uint8_t dsm[];
  uint8_t* ktab = dsm;
  uint8_t* vtab = dsm + TABB;
  uint8_t* stages = dsm + 2 * TABB;

  // The valid length: p.T, or read from device memory at run time (CUDA-graph replays of a
  // growing cache) and clamped to the capacity p.T the splits were sized for. CTAs whose
  // tiles all lie past it run no tile and write an empty partial (m = -inf, l = 0, o = 0),
  // which the combine weights by 0.
  const int T = p.vlen ? max(0, min(__ldg(p.vlen), p.T)) : p.T;
  const int nsteps = (T + 15) / 16;
  const int first = sp * p.steps_per_split;
  const int last = min(first + p.steps_per_split, nsteps);

  // ---- start this warp's pipeline first (the DRAM stream), then the tables
  CpCursor cur;
  int moff_k, moff_v;
  {
    const int t0 = (first + warp) * 16;
    cur.t0 = t0;
    cur.c0 = p.kc + bh * p.k_cs + (long long)t0 * CB + 16 * lane;
    cur.vc0 = p.vc + bh * p.v_cs + (long long)t0 * CB + 16 * lane;
    cur.r = (lane < 16 ? p.kr + bh * p.k_rs : p.vr + bh * p.v_rs) + (long long)t0 * RB + 16 * (lane & 15);
    const uint8_t* mk = reinterpret_cast<const uint8_t*>(p.km + bh * p.k_ms + t0);
    const uint8_t* mv = reinterpret_cast<const uint8_t*>(p.vm + bh * p.v_ms + t0);
    moff_k = (int)(reinterpret_cast<uintptr_t>(mk) & 15);
    moff_v = (int)(reinterpret_cast<uintptr_t>(mv) & 15);
    const uint8_t* mine = lane < 3 ? mk : mv;
    cur.m = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(mine) & ~uintptr_t(15)) + 16 * (lane % 3);
    cur.mlast = reinterpret_cast<const uint8_t*>(lane < 3 ? p.km + bh * p.k_ms + (T - 1) : p.vm + bh * p.v_ms + (T - 1));
  }
  // The kv head's two codebooks: cp.async, every thread's 16-byte pieces in flight at once
  // (one group, committed before the stage prologue, so the loop's first wait covers it).
  // GPU run 16 copied them through registers (__ldg + store, a few loads in flight per
  // thread): ~36 KB of L2 latency at the start of every CTA.
  {
    const uint8_t* kt = reinterpret_cast<const uint8_t*>(p.ktab) + (long long)h * p.tab_bytes;
    const uint8_t* vt = reinterpret_cast<const uint8_t*>(p.vtab) + (long long)h * p.tab_bytes;
    const uint32_t ka = smem_u32(ktab), va = smem_u32(vtab);
    const int n = p.tab_bytes / 16;
    for (int i = threadIdx.x; i < n; i += NW * 32) {
      cp_async16(ka + 16 * i, kt + 16 * i, true);
      cp_async16(va + 16 * i, vt + 16 * i, true);
    }
    cp_commit();
  }
  const uint8_t* wsm = stages + warp * (SMS * Stage::BYTES);
  const uint32_t wsa = smem_u32(wsm);
  const int ntile = last > first + warp ? (last - first - warp + NW - 1) / NW : 0;
#pragma unroll
  for (int i = 0; i < SMS - 1; ++i) {
    copy_tile<NW>(wsa + i * Stage::BYTES, cur, T, i < ntile, lane);
    cp_commit();
  }

  uint32_t qb[KS][2];
  {
    const bool real = g < p.gqa;
    const long long row = (long long)bh * p.gqa + g;
    if (p.qtype == 0) load_q(reinterpret_cast<const __half*>(p.q), row, real, c, qb);
    else if (p.qtype == 1) load_q(reinterpret_cast<const uint16_t*>(p.q), row, real, c, qb);
    else load_q(reinterpret_cast<const float*>(p.q), row, real, c, qb);
  }
  float acc[KS][4];
#pragma unroll
  for (int i = 0; i < KS; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
  cp_wait<SMS - 1>();  // this thread's table pieces (the oldest group) have landed
  __syncthreads();     // and every thread's: the tables are in

  int rd = 0, wr = SMS - 1;
  for (int j = 0; j < ntile; ++j) {
    __syncwarp();
    copy_tile<NW>(wsa + wr * Stage::BYTES, cur, T, j + SMS - 1 < ntile, lane);
    cp_commit();
    cp_wait<SMS - 1>();
    __syncwarp();
    tile_step(wsm + rd * Stage::BYTES, ktab, vtab, moff_k, moff_v, (first + warp + j * NW) * 16, T, p.qk_scale, qb,
              acc, m, l, g, c);
    rd = rd == SMS - 1 ? 0 : rd + 1;
    wr = wr == SMS - 1 ? 0 : wr + 1;
  }
  cp_wait<0>();

#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) l[e] += __shfl_xor_sync(0xffffffffu, l[e], o);
  }
  __shared__ float sm_m[NW][8], sm_l[NW][8];
  __syncthreads();  // every warp is done with the tables and stages: reuse them for the merge
  float(*red)[8][D] = reinterpret_cast<float(*)[8][D]>(dsm);
  if (g == 0) {
    sm_m[warp][2 * c] = m[0]; sm_m[warp][2 * c + 1] = m[1];
    sm_l[warp][2 * c] = l[0]; sm_l[warp][2 * c + 1] = l[1];
  }
  __syncthreads();
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int hd = 2 * c + e;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w][hd]);
    const float f = (m[e] == NEG_INF) ? 0.f : exp2f(m[e] - M);
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
      const int d = g * (D / 8) + 2 * mt;
      red[warp][hd][d] = f * acc[mt][e];
      red[warp][hd][d + 1] = f * acc[mt][2 + e];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < p.gqa * D; idx += NW * 32) {
    const int hd = idx / D, d = idx % D;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) o += red[w][hd][d];
    const long long prow = ((long long)bh * p.gqa + hd) * p.nsplit + sp;
    p.po[prow * D + d] = o;
    if (d == 0) {
      float M = NEG_INF, L = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w][hd]);
#pragma unroll
      for (int w = 0; w < NW; ++w) L += (sm_m[w][hd] == NEG_INF) ? 0.f : sm_l[w][hd] * exp2f(sm_m[w][hd] - M);
      // No valid token at all (valid length 0): every split is empty and the combine would
      // return 0/0; split 0 then says (m = 0, l = 1, o = 0), so the output is zeros, the
      // flash-attention convention for a fully masked row.
      const bool none = T == 0 && sp == 0;
      p.pm[prow] = none ? 0.f : M;
      p.pl[prow] = none ? 1.f : L;
    }
  }
}


// Launch variants: {warps per CTA, cp.async stages per warp, min CTAs per SM (a register cap)}.
// GPU run 1 (NOTES.md) had min 1 everywhere: 168-176 registers = 2 CTAs of 4 warps per SM;
// the caps (3 x 4 warps: 167 registers, 2 x 8 warps: 128) compile without spills (offline).
// Since the tables are copied by cp.async (run 17) every instance needs ~120 registers, no
// spills (the __ldg copy loop had set the peak: 167-177), so shared memory (36 KB of tables
// + NW x SMS x 2144 B per CTA) decides the CTAs per SM. 5..8 (run 17) take 16 warps per SM
// for the latency of the bank-conflicted gathers: 2 CTAs of 8 warps with 4 stages (v3 has
// 2), 4 CTAs of 4 warps with 2, one CTA of 16 warps with 4 or 5 (one copy of the tables
// per SM). 20 warps (102 registers) spilled 60 bytes offline: not taken.
constexpr int VARIANTS[][3] = {{4, 4, 3}, {8, 4, 1}, {4, 3, 3}, {8, 2, 2}, {4, 6, 1},
                               {8, 4, 2}, {4, 2, 4}, {16, 4, 1}, {16, 5, 1}};
constexpr int NVARIANTS = 9;
constexpr int TAB_SMALL = 192 * 96;   // S <= 96
constexpr int TAB_LARGE = 192 * 170;  // S <= 170 (fill=true at 12 bits)
static_assert(TAB_SMALL % 16 == 0, "table alignment");

template <int V, int TABB>
constexpr int smem_of() {
  return dyn_smem<VARIANTS[V][0], VARIANTS[V][1], (TABB + 15) / 16 * 16>();
}
template <int V, int TABB>
constexpr auto kernel_of() {
  return hqmq_split_kernel<VARIANTS[V][0], VARIANTS[V][1], (TABB + 15) / 16 * 16, VARIANTS[V][2]>;
}

// The dynamic shared-memory opt-in, once per instance (also before an occupancy query).
template <int V, int TABB>
int prepare() {
  static cudaError_t e = cudaFuncSetAttribute(kernel_of<V, TABB>(), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              smem_of<V, TABB>());
  return (int)e;
}

template <int V, int TABB>
int launch_v(const Params& p, int rows, cudaStream_t stream) {
  if (const int e = prepare<V, TABB>()) return e;
  kernel_of<V, TABB>()<<<dim3(rows, p.nsplit), VARIANTS[V][0] * 32, smem_of<V, TABB>(), stream>>>(p);
  return 0;
}

// CTAs of this instance resident per SM (registers, shared memory, threads); < 0: -error.
template <int V, int TABB>
int occupancy_v() {
  if (const int e = prepare<V, TABB>()) return -e;
  int n = 0;
  const cudaError_t e =
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel_of<V, TABB>(), VARIANTS[V][0] * 32, smem_of<V, TABB>());
  return e == cudaSuccess ? n : -(int)e;
}

template <int V, int TABB>
int regs_v() {
  constexpr int TB = (TABB + 15) / 16 * 16;
  cudaFuncAttributes a;
  const cudaError_t e =
      cudaFuncGetAttributes(&a, hqmq_split_kernel<VARIANTS[V][0], VARIANTS[V][1], TB, VARIANTS[V][2]>);
  return e == cudaSuccess ? a.numRegs : -(int)e;
}

template <int TABB>
int launch_t(const Params& p, int rows, int variant, cudaStream_t s) {
  switch (variant) {
    case 1: return launch_v<1, TABB>(p, rows, s);
    case 2: return launch_v<2, TABB>(p, rows, s);
    case 3: return launch_v<3, TABB>(p, rows, s);
    case 4: return launch_v<4, TABB>(p, rows, s);
    case 5: return launch_v<5, TABB>(p, rows, s);
    case 6: return launch_v<6, TABB>(p, rows, s);
    case 7: return launch_v<7, TABB>(p, rows, s);
    case 8: return launch_v<8, TABB>(p, rows, s);
    default: return launch_v<0, TABB>(p, rows, s);
  }
}

}  // namespace

// Returns a cudaError_t (0 = launched) or -1 (S too large for the tables).
extern "C" int kvq_hqmq_decode(const void* q, int qtype, const void* kc, const void* kr, const void* km,
                               const void* vc, const void* vr, const void* vm, const void* ktab, const void* vtab,
                               long long k_cs, long long k_rs, long long k_ms, long long v_cs, long long v_rs,
                               long long v_ms, int B, int Hkv, int gqa, int T, int S, int steps_per_split,
                               int nsplit, float qk_scale, float* po, float* pm, float* pl, void* out, int otype,
                               int variant, const int* vlen, void* stream) {
  Params p;
  p.vlen = vlen;
  p.q = q; p.qtype = qtype;
  p.kc = (const uint8_t*)kc; p.kr = (const uint8_t*)kr; p.km = (const uint16_t*)km;
  p.vc = (const uint8_t*)vc; p.vr = (const uint8_t*)vr; p.vm = (const uint16_t*)vm;
  p.ktab = (const uint16_t*)ktab; p.vtab = (const uint16_t*)vtab;
  p.k_cs = k_cs; p.k_rs = k_rs; p.k_ms = k_ms; p.v_cs = v_cs; p.v_rs = v_rs; p.v_ms = v_ms;
  p.T = T; p.Hkv = Hkv; p.gqa = gqa; p.steps_per_split = steps_per_split; p.nsplit = nsplit;
  p.tab_bytes = 192 * S; p.qk_scale = qk_scale;
  p.po = po; p.pm = pm; p.pl = pl;
  const int rows = B * Hkv;
  cudaStream_t s = (cudaStream_t)stream;
  int e;
  if (192 * S <= TAB_SMALL) e = launch_t<TAB_SMALL>(p, rows, variant, s);
  else if (192 * S <= TAB_LARGE) e = launch_t<TAB_LARGE>(p, rows, variant, s);
  else return -1;
  if (e) return e;
  const int rows_q = rows * gqa;
  const int threads = (COMBINE_THREADS / D) * D;
  if (otype == 0) combine_kernel<__half><<<rows_q, threads, 0, s>>>(po, pm, pl, (__half*)out, nsplit, D);
  else if (otype == 1) combine_kernel<uint16_t><<<rows_q, threads, 0, s>>>(po, pm, pl, (uint16_t*)out, nsplit, D);
  else combine_kernel<float><<<rows_q, threads, 0, s>>>(po, pm, pl, (float*)out, nsplit, D);
  return (int)cudaGetLastError();
}

extern "C" int kvq_hqmq_num_variants() { return NVARIANTS; }

extern "C" int kvq_hqmq_occupancy(int variant, int S) {
  const bool small = 192 * S <= TAB_SMALL;
  switch (variant) {
    case 1: return small ? occupancy_v<1, TAB_SMALL>() : occupancy_v<1, TAB_LARGE>();
    case 2: return small ? occupancy_v<2, TAB_SMALL>() : occupancy_v<2, TAB_LARGE>();
    case 3: return small ? occupancy_v<3, TAB_SMALL>() : occupancy_v<3, TAB_LARGE>();
    case 4: return small ? occupancy_v<4, TAB_SMALL>() : occupancy_v<4, TAB_LARGE>();
    case 5: return small ? occupancy_v<5, TAB_SMALL>() : occupancy_v<5, TAB_LARGE>();
    case 6: return small ? occupancy_v<6, TAB_SMALL>() : occupancy_v<6, TAB_LARGE>();
    case 7: return small ? occupancy_v<7, TAB_SMALL>() : occupancy_v<7, TAB_LARGE>();
    case 8: return small ? occupancy_v<8, TAB_SMALL>() : occupancy_v<8, TAB_LARGE>();
    default: return small ? occupancy_v<0, TAB_SMALL>() : occupancy_v<0, TAB_LARGE>();
  }
}

extern "C" int kvq_hqmq_num_regs(int variant, int S) {
  const bool small = 192 * S <= TAB_SMALL;
  switch (variant) {
    case 1: return small ? regs_v<1, TAB_SMALL>() : regs_v<1, TAB_LARGE>();
    case 2: return small ? regs_v<2, TAB_SMALL>() : regs_v<2, TAB_LARGE>();
    case 3: return small ? regs_v<3, TAB_SMALL>() : regs_v<3, TAB_LARGE>();
    case 4: return small ? regs_v<4, TAB_SMALL>() : regs_v<4, TAB_LARGE>();
    case 5: return small ? regs_v<5, TAB_SMALL>() : regs_v<5, TAB_LARGE>();
    case 6: return small ? regs_v<6, TAB_SMALL>() : regs_v<6, TAB_LARGE>();
    case 7: return small ? regs_v<7, TAB_SMALL>() : regs_v<7, TAB_LARGE>();
    case 8: return small ? regs_v<8, TAB_SMALL>() : regs_v<8, TAB_LARGE>();
    default: return small ? regs_v<0, TAB_SMALL>() : regs_v<0, TAB_LARGE>();
  }
}
