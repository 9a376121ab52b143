// One eager decode step's cache write, K and V in ONE launch (kernels/cuda/step_write.py says
// which formats and why): naive int (per-token groups along the head dim), fp8 (a per-kv-head
// scale), the engine's fp16 store, KIVI's fp16 window row (its flushes, every G steps, stay the
// Triton int launch) and HQMQ, with or without Med3x (the O(S) direction search of each chunk;
// Med3x: the chunk radii's median, the outliers appended to their (b, h) lists).
// The bytes are those of kernels/step_encode.py's Triton encoders (`int_rows`, `fp8_tokens`,
// `fp16_tokens`, `kivi_window`) and kernels/hqmq_encode.py's `_hqmq_kernel`, which follow torch
// op by op: built WITHOUT --use_fast_math and with -fmad=false (library.py EXACT_FLAGS), IEEE
// division (__fdiv_rn), round half to even; HQMQ's sums and products spelled as __fadd_rn /
// __fmul_rn in the Triton kernel's order.
// Errors as theirs: bits in the role's flag row (1 NaN/Inf, 2 beyond fp16), the first bad
// token (atomicMin), the count of bad values.
//
// Grid (B * H, 2 roles), one warp per (b, h, role) row of D <= 256 elements (a write is a
// few KB: its time is the launch's; the Triton path pays two launches and their argument
// binding, ~50-150 us per layer on an H100, NOTES.md 2026-12-06).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int MAX_D = 256;
constexpr int MAX_S = 256;  // HQMQ secondaries a row's search reads from shared memory (4 KB)

// One role's destination (every stride in elements of its field; x's in elements of x)
struct WriteRole {
  uint8_t* c;          // int / fp8: codes [B, H, Tcap, NB or D] bytes; fp16: values (as uint8_t*)
  uint16_t* s;         // int: scale [B, H, Tcap, NG] fp16 bits; fp8: unused
  uint16_t* z;         // int: zero, as s
  const float* hs;     // fp8: scale [H] fp32
  int* err;            // this role's flag row (int32 x 4: bits, first bad token, bad values, -)
  long long cb, ch, ct;  // codes / values strides
  long long sb, sh, st;  // scale / zero strides
  long long xb, xh;      // x strides (x's last dim contiguous)
  // HQMQ (kind 4; c: its code rows): radius codes [B, H, Tcap, RB] bytes, r_max [B, H, Tcap] fp16
  // bits, the normalised secondaries [H, S, 4] fp32 (16-byte aligned), their strides
  uint8_t* rad;
  uint16_t* rmax;
  const float* sec;
  long long rxb, rxh, rxt, mxb, mxh, mxt;
  long long S, cbits, rbits;  // secondaries, code bits, radius bits (uniform levels)
  // HQMQ + Med3x (med3 != 0): flag rows [B, H, Tcap, FB] bytes, the outlier lists [B, H, Ocap, 4]
  // fp16 (entries contiguous), their lengths [B * H] int64, the 64-token block starts
  // [B, H, nblk] int32; strides in elements; C the outlier threshold (r > C * median)
  uint8_t* flags;
  uint16_t* outl;
  long long* olen;
  int* oidx;
  long long fxb, fxh, fxt, oxb, oxh, ixb, ixh;
  long long med3;
  float C;
  int pad_;
};

struct WritePlan {
  long long kind;   // 0 int, 1 fp8 e4m3, 2 fp8 e5m2, 3 fp16, 4 HQMQ
  long long xtype;  // 0 fp16, 1 bf16, 2 fp32
  long long B, H, D, bits, G;
  WriteRole role[2];
};

__device__ __forceinline__ float load_x(const void* x, long long i, int xtype) {
  if (xtype == 0) return __half2float(static_cast<const __half*>(x)[i]);
  if (xtype == 1) return __bfloat162float(static_cast<const __nv_bfloat16*>(x)[i]);
  return static_cast<const float*>(x)[i];
}

__device__ __forceinline__ bool nonfinite(float v) { return !isfinite(v); }

__device__ __forceinline__ uint16_t half_bits(__half h) { return __half_as_ushort(h); }

// the error bits of a row into its role's flag row (one lane)
__device__ __forceinline__ void raise_flag(int* err, int bits, int n_bad, int token) {
  if (bits) {
    atomicOr(err, bits);
    atomicMin(err + 1, token);
    atomicAdd(err + 2, n_bad);
  }
}

// fp8 code of y (already divided by the scale), by step_encode's integer arithmetic: M
// mantissa bits, EMIN the smallest normal exponent, MAXV the largest finite value
__device__ __forceinline__ uint8_t fp8_code(float y, int M, int EMIN, float MAXV) {
  y = fminf(fmaxf(y, -MAXV), MAXV);
  const int ybits = __float_as_int(y);
  const float a = fabsf(y);
  const int ex = max(((__float_as_int(a) >> 23) & 0xFF) - 127, EMIN);
  const float q = rintf(a * __int_as_float((127 + M - ex) << 23));  // a / 2^(ex - M): exact
  int code = (int)q + ((ex - EMIN) << M);  // q = 2^(M+1) carries into the exponent
  code |= (ybits >> 24) & 0x80;            // the sign, -0 included
  return (uint8_t)code;
}

// bytes [0, (n * BITS + 7) / 8) of the BITS-bit values v[0..n) (0 <= v < 2^BITS), LSB first
// (quantizers/packing.py; step_encode `pack_row`): byte j gathers every value overlapping it
__device__ void pack_bits(const int* v, int n, int BITS, uint8_t* dst, int lane) {
  const int NB = (n * BITS + 7) / 8;
  for (int j = lane; j < NB; j += 32) {
    int acc = 0;
    const int i1 = min((8 * j + 7) / BITS, n - 1);
    for (int i = (8 * j) / BITS; i <= i1; ++i) {
      const int sh = i * BITS - 8 * j;
      acc |= (sh >= 0 ? v[i] << sh : v[i] >> -sh) & 0xFF;
    }
    dst[j] = (uint8_t)acc;
  }
}

// ---- HQMQ (hqmq_encode.py `_hqmq_kernel` / `best_codes`, uniform radius levels) ----
// The per-chunk arithmetic is host-and-device: `kvq_hqmq_rows_host` runs it on a CPU, where
// a test holds it to the Triton encoder without a GPU (x86-64 rounds each float op: no FMA
// without -mfma).
#ifdef __CUDA_ARCH__
#define HD __device__ __forceinline__
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float dvd(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float root(float a) { return __fsqrt_rn(a); }
#else
#define HD __host__ __device__ inline
inline float add(float a, float b) { return a + b; }
inline float sub(float a, float b) { return a - b; }
inline float mul(float a, float b) { return a * b; }
inline float dvd(float a, float b) { return a / b; }
inline float root(float a) { return sqrtf(a); }
#endif

// a chunk's radius, as torch's norm: the squares summed in order (hqmq_encode `norm4`)
HD float chunk_radius(const float* x) {
  return root(add(add(add(mul(x[0], x[0]), mul(x[1], x[1])), mul(x[2], x[2])), mul(x[3], x[3])));
}

// the unit direction of a chunk of radius r (1, 0, 0, 0 for r = 0)
HD void unit(const float* x, float r, float (&u)[4]) {
  const bool pos = r > 0.0f;
  u[0] = pos ? dvd(x[0], r) : 1.0f;
  u[1] = pos ? dvd(x[1], r) : 0.0f;
  u[2] = pos ? dvd(x[2], r) : 0.0f;
  u[3] = pos ? dvd(x[3], r) : 0.0f;
}

// radius code of r against the row's fp16 r_max rm, L levels (step_encode `rne`, then clamped)
HD int radius_code(float r, float rm, int L) {
  const float y = mul(dvd(r, rm > 0.0f ? rm : 1.0f), (float)L);
  return (int)fminf(fmaxf(sub(add(y, 12582912.0f), 12582912.0f), 0.0f), (float)L);
}

// whether r is the lower median of the NC radii (torch.median: at most k smaller, more than k
// smaller or equal, k = (NC - 1) / 2)
HD bool lower_median(const float* radii, int NC, float r) {
  int less = 0, leq = 0;
  for (int j = 0; j < NC; ++j) {
    less += radii[j] < r;
    leq += radii[j] <= r;
  }
  return less <= (NC - 1) / 2 && leq > (NC - 1) / 2;
}

// v = u * conj(s) (triton/common.py `hamilton`, its term order)
HD void times_conj(const float (&u)[4], float4 s, float (&v)[4]) {
  const float b0 = s.x, b1 = -s.y, b2 = -s.z, b3 = -s.w;
  v[0] = sub(sub(sub(mul(u[0], b0), mul(u[1], b1)), mul(u[2], b2)), mul(u[3], b3));
  v[1] = sub(add(add(mul(u[0], b1), mul(u[1], b0)), mul(u[2], b3)), mul(u[3], b2));
  v[2] = add(add(sub(mul(u[0], b2), mul(u[1], b3)), mul(u[2], b0)), mul(u[3], b1));
  v[3] = add(sub(add(mul(u[0], b3), mul(u[1], b2)), mul(u[2], b1)), mul(u[3], b0));
}

// sum |v_i| / 2, summed left to right
HD float half_score(const float (&a)[4]) { return mul(add(add(add(a[0], a[1]), a[2]), a[3]), 0.5f); }

// code p * S + s of the unit chunk u: the first secondary s of the best score max(max |v_i|,
// sum |v_i| / 2) over v = u conj(s), then p = nearest_hurwitz(v) (ties to the axis element,
// the lowest axis)
HD int best_code(const float (&u)[4], const float4* sec, int S) {
  float best = -1.0f;
  int bi = 0;
  float v[4], a[4];
  for (int s = 0; s < S; ++s) {
    times_conj(u, sec[s], v);
    for (int i = 0; i < 4; ++i) a[i] = fabsf(v[i]);
    const float score = fmaxf(fmaxf(fmaxf(a[0], a[1]), fmaxf(a[2], a[3])), half_score(a));
    if (score > best) {
      best = score;
      bi = s;
    }
  }
  times_conj(u, sec[bi], v);
  for (int i = 0; i < 4; ++i) a[i] = fabsf(v[i]);
  float ax_s = a[0], ax_v = v[0];
  int ax = 0;
  for (int i = 1; i < 4; ++i) {
    if (a[i] > ax_s) {
      ax = i;
      ax_v = v[i];
    }
    ax_s = fmaxf(ax_s, a[i]);
  }
  const int axis_idx = 2 * ax + (ax_v < 0.0f);
  const int half_idx = 8 + (v[0] < 0.0f) + 2 * (v[1] < 0.0f) + 4 * (v[2] < 0.0f) + 8 * (v[3] < 0.0f);
  return (half_score(a) > ax_s ? half_idx : axis_idx) * S + bi;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Med3x (`_hqmq_kernel` with MED3, one token): whether each of the lane's chunks is an outlier,
// r > C * the lower median of the row's chunk radii (torch.median: the radius with at most k
// smaller and more than k smaller-or-equal, k = (NC - 1) / 2), and r > 0
__device__ void med3_outliers(const WriteRole& w, const float (&r)[2], int NC, int lane, float* radii, bool (&o)[2]) {
#pragma unroll
  for (int k = 0; k < 2; ++k)
    if (lane + 32 * k < NC) radii[lane + 32 * k] = r[k];
  __syncwarp();
  float med = -1.0f;
#pragma unroll
  for (int k = 0; k < 2; ++k)
    if (lane + 32 * k < NC && lower_median(radii, NC, r[k])) med = fmaxf(med, r[k]);
  const float thr = mul(w.C, warp_max(med));
#pragma unroll
  for (int k = 0; k < 2; ++k) o[k] = lane + 32 * k < NC && r[k] > thr && r[k] > 0.0f;
}

// Med3x's stores of one token row: its flag bits, its outlier chunks (fp16) at the end of its
// (b, h) list in chunk order, the list's new length, the block start when the token opens a
// 64-token block (blk >= 0); returns the error bits (2: an outlier beyond fp16)
__device__ int med3_store(const WriteRole& w, const float* xs, const bool (&o)[2], int NC, long long b, long long h,
                          long long H, long long t, int blk, int lane) {
  const unsigned m0 = __ballot_sync(0xffffffffu, o[0]), m1 = __ballot_sync(0xffffffffu, o[1]);
  const unsigned long long mask = ((unsigned long long)m1 << 32) | m0;
  for (int j = lane; j < (NC + 7) / 8; j += 32) w.flags[b * w.fxb + h * w.fxh + t * w.fxt + j] = (uint8_t)(mask >> (8 * j));
  const long long start = w.olen[b * H + h];
  const unsigned below = (1u << lane) - 1u;
  float big = 0.0f;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    if (!o[k]) continue;
    const long long dest = start + (k ? __popc(m0) + __popc(m1 & below) : __popc(m0 & below));
    uint16_t* e = w.outl + b * w.oxb + h * w.oxh + dest * 4;
    const float* x = xs + 4 * (lane + 32 * k);
    for (int i = 0; i < 4; ++i) {
      e[i] = __half_as_ushort(__float2half_rn(x[i]));
      big = fmaxf(big, fabsf(x[i]));
    }
  }
  big = warp_max(big);
  __syncwarp();  // (every lane has read the length)
  if (lane == 0) {
    w.olen[b * H + h] = start + __popc(m0) + __popc(m1);
    if (blk >= 0) w.oidx[b * w.ixb + h * w.ixh + blk] = (int)start;
  }
  return big > 65504.0f ? 2 : 0;
}

// one HQMQ token row: lane l takes chunks l, l + 32; code and radius codes into the shared
// arrays, r_max by a warp max; Med3x's outliers left out of both (and stored by med3_store);
// returns the error bits (2: r_max, or an outlier, beyond fp16)
__device__ int hqmq_row(const WriteRole& w, const float* xs, int D, long long b, long long h, long long H, long long t,
                        int blk, int lane, int* codes, int* rq, float4* sec, float* radii) {
  const int S = (int)w.S, NC = D / 4, L = (1 << (int)w.rbits) - 1;
  for (int s = lane; s < S; s += 32) sec[s] = reinterpret_cast<const float4*>(w.sec)[h * S + s];
  float r[2] = {0.0f, 0.0f};
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int c = lane + 32 * k;
    if (c >= NC) continue;
    r[k] = chunk_radius(xs + 4 * c);
  }
  bool o[2] = {false, false};
  if (w.med3) med3_outliers(w, r, NC, lane, radii, o);
  __syncwarp();  // (the secondaries)
  float r_max = 0.0f;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int c = lane + 32 * k;
    if (c >= NC) continue;
    if (o[k]) {  // its code is stored as 0 (its radius code is 0): no search
      r[k] = 0.0f;
      codes[c] = 0;
      continue;
    }
    float u[4];
    unit(xs + 4 * c, r[k], u);
    codes[c] = best_code(u, sec, S);
    r_max = fmaxf(r_max, r[k]);
  }
  r_max = warp_max(r_max);
  const __half rm16 = __float2half_rn(r_max);
  const float rm = __half2float(rm16);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int c = lane + 32 * k;
    if (c >= NC) continue;
    rq[c] = radius_code(r[k], rm, L);
    if (rq[c] == 0) codes[c] = 0;  // a chunk that decodes to zero stores code 0
  }
  __syncwarp();
  pack_bits(codes, NC, (int)w.cbits, w.c + b * w.cb + h * w.ch + t * w.ct, lane);
  pack_bits(rq, NC, (int)w.rbits, w.rad + b * w.rxb + h * w.rxh + t * w.rxt, lane);
  if (lane == 0) w.rmax[b * w.mxb + h * w.mxh + t * w.mxt] = __half_as_ushort(rm16);
  const int over = r_max > 65504.0f ? 2 : 0;
  return w.med3 ? over | med3_store(w, xs, o, NC, b, h, H, t, blk, lane) : over;
}

__global__ void write_kernel(WritePlan p, const void* xk, const void* xv, int rowk, int rowv, int tokk, int tokv,
                             int blkk, int blkv) {
  __shared__ float xs[MAX_D];
  __shared__ int qs[MAX_D];
  __shared__ float gs[MAX_D], gz[MAX_D];  // int: each group's scale and zero (fp16 values)
  __shared__ int rs[MAX_D / 4];           // HQMQ: radius codes (qs: the direction codes)
  __shared__ float4 ss[MAX_S];            // HQMQ: the kv head's secondaries
  __shared__ float radii[MAX_D / 4];       // HQMQ + Med3x: the row's chunk radii (its median)
  const int lane = threadIdx.x;
  const int bh = blockIdx.x, r = blockIdx.y;
  const long long b = bh / p.H, h = bh % p.H;
  const WriteRole& w = p.role[r];
  const void* x = r ? xv : xk;
  const int t = r ? rowv : rowk;  // the row of the store's token axis written (KIVI: of its window)
  const int tok = r ? tokv : tokk;  // the token its flags name
  const int D = (int)p.D;
  const long long xo = b * w.xb + h * w.xh;
  int n_bad = 0;
  for (int e = lane; e < D; e += 32) {
    const float v = load_x(x, xo + e, (int)p.xtype);
    xs[e] = v;
    n_bad += nonfinite(v);
  }
  __syncwarp();
  int bits = 0;
  const long long co = b * w.cb + h * w.ch + (long long)t * w.ct;
  if (p.kind == 0) {  // naive int: step_encode `_int_rows_kernel`, one token row
    const int G = (int)p.G, NG = D / G, BITS = (int)p.bits;
    const float maxq = (float)((1 << BITS) - 1);
    const long long so = b * w.sb + h * w.sh + (long long)t * w.st;
    bool over = false;
    for (int g = lane; g < NG; g += 32) {
      float lo = INFINITY, hi = -INFINITY;
      for (int i = g * G; i < g * G + G; ++i) {
        lo = fminf(lo, xs[i]);
        hi = fmaxf(hi, xs[i]);
      }
      const __half zh = __float2half_rd(lo);  // the fp16 zero rounded down, the scale up
      const float span = __fdiv_rn(__fsub_rn(hi, __half2float(zh)), maxq);
      const __half sh = __float2half_ru(span);
      over |= fabsf(lo) > 65504.0f || fabsf(hi) > 65504.0f || span > 65504.0f;
      w.s[so + g] = half_bits(sh);
      w.z[so + g] = half_bits(zh);
      gs[g] = __half2float(sh);
      gz[g] = __half2float(zh);
    }
    __syncwarp();
    for (int e = lane; e < D; e += 32) {
      const float s = gs[e / G], z = gz[e / G];
      float q = s > 0.0f ? rintf(__fdiv_rn(__fsub_rn(xs[e], z), s)) : 0.0f;
      q = fminf(fmaxf(q, 0.0f), maxq);  // (NaN input: its row is flagged, its bytes unused)
      qs[e] = (int)q;
    }
    __syncwarp();
    pack_bits(qs, D, BITS, w.c + co, lane);
    bits = __any_sync(0xffffffffu, over) ? 2 : 0;
  } else if (p.kind <= 2) {  // fp8: step_encode `_fp8_kernel`
    const int M = p.kind == 1 ? 3 : 2, EMIN = p.kind == 1 ? -6 : -14;
    const float MAXV = p.kind == 1 ? 448.0f : 57344.0f;
    const float scale = w.hs[h];
    for (int e = lane; e < D; e += 32) w.c[co + e] = fp8_code(__fdiv_rn(xs[e], scale), M, EMIN, MAXV);
  } else if (p.kind == 4) {  // HQMQ: hqmq_encode `_hqmq_kernel`
    bits = hqmq_row(w, xs, D, b, h, p.H, t, r ? blkv : blkk, lane, qs, rs, ss, radii);
  } else {  // fp16: step_encode `_fp16_kernel`
    bool over = false;
    uint16_t* vals = reinterpret_cast<uint16_t*>(w.c);
    for (int e = lane; e < D; e += 32) {
      const float v = xs[e];
      over |= fabsf(v) > 65504.0f && !nonfinite(v);
      vals[co + e] = half_bits(__float2half_rn(v));
    }
    bits = __any_sync(0xffffffffu, over) ? 2 : 0;
  }
  for (int o = 16; o > 0; o >>= 1) n_bad += __shfl_xor_sync(0xffffffffu, n_bad, o);
  if (lane == 0) raise_flag(w.err, bits | (n_bad > 0 ? 1 : 0), n_bad, tok);
}

}  // namespace

// The HQMQ write's arithmetic on the host, one row after another (what hqmq_row computes with
// a warp, in one thread): rows x [n, NC, 4] fp32 of one kv head, its secondaries sec [S, 4];
// out: the direction codes and radius codes [n, NC], r_max [n] (fp16 bits), Med3x's outlier
// mask [n, NC] (0 without med3). For tests on machines without a GPU.
extern "C" int kvq_hqmq_rows_host(const float* x, int n, int NC, const float* sec, int S, int rbits, int med3,
                                  float C, int* codes, int* rq, uint16_t* rmax, int* outl) {
  if (NC < 1 || NC > MAX_D / 4 || S < 1 || rbits < 1 || rbits > 8) return 1;
  const float4* s4 = reinterpret_cast<const float4*>(sec);
  float r[MAX_D / 4];
  for (int row = 0; row < n; ++row) {
    const float* xr = x + (long long)row * NC * 4;
    int* cr = codes + (long long)row * NC;
    int* qr = rq + (long long)row * NC;
    int* orow = outl + (long long)row * NC;
    for (int c = 0; c < NC; ++c) r[c] = chunk_radius(xr + 4 * c);
    float thr = INFINITY;
    if (med3) {
      float med = -1.0f;
      for (int c = 0; c < NC; ++c)
        if (lower_median(r, NC, r[c])) med = fmaxf(med, r[c]);
      thr = mul(C, med);
    }
    float r_max = 0.0f;
    for (int c = 0; c < NC; ++c) {
      orow[c] = med3 && r[c] > thr && r[c] > 0.0f;
      float u[4];
      unit(xr + 4 * c, r[c], u);
      cr[c] = orow[c] ? 0 : best_code(u, s4, S);
      if (!orow[c]) r_max = fmaxf(r_max, r[c]);
    }
    const __half rm16 = __float2half_rn(r_max);
    rmax[row] = __half_as_ushort(rm16);
    for (int c = 0; c < NC; ++c) {
      qr[c] = orow[c] ? 0 : radius_code(r[c], __half2float(rm16), (1 << rbits) - 1);
      if (qr[c] == 0) cr[c] = 0;
    }
  }
  return 0;
}

extern "C" int kvq_write_plan_size() { return (int)sizeof(WritePlan); }
extern "C" int kvq_write_max_d() { return MAX_D; }

// One layer's one-token write: xk, xv [B, H, 1, D] of the plan's dtype, at rows rowk / rowv of
// the two stores' token axes (a KIVI window's row: fp16 kind), flagged as tokens tokk / tokv;
// blkk / blkv: HQMQ + Med3x's 64-token block the token opens (-1: none).
// Launches only (no allocation, no synchronisation). (plan is a WritePlan*: a namespace-local
// type in the signature would hide the entry from ctypes.)
extern "C" int kvq_write_pair(const void* plan, const void* xk, const void* xv, int rowk, int rowv, int tokk,
                              int tokv, int blkk, int blkv, void* stream) {
  const WritePlan* p = static_cast<const WritePlan*>(plan);
  if (p->D < 1 || p->D > MAX_D || (p->kind == 0 && (p->G < 1 || p->D % p->G))) return (int)cudaErrorInvalidValue;
  for (int r = 0; r < 2 && p->kind == 4; ++r) {
    const WriteRole& w = p->role[r];
    if (p->D % 4 || w.S < 1 || w.S > MAX_S || w.cbits < 1 || w.cbits > 16 || w.rbits < 1 || w.rbits > 8 ||
        (w.med3 && (!w.flags || !w.outl || !w.olen || !w.oidx)))
      return (int)cudaErrorInvalidValue;
  }
  write_kernel<<<dim3((unsigned)(p->B * p->H), 2), 32, 0, static_cast<cudaStream_t>(stream)>>>(*p, xk, xv, rowk, rowv,
                                                                                                tokk, tokv, blkk, blkv);
  return (int)cudaGetLastError();
}
