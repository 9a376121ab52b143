// One eager decode step's cache write, K and V in ONE launch, for the formats whose step
// encoders are simple (kernels/cuda/step_write.py says which and why): naive int (per-token
// groups along the head dim), fp8 (a per-kv-head scale), the engine's fp16 store, and KIVI's
// fp16 window row (its flushes, every G steps, stay the Triton int launch).
// The bytes are those of kernels/step_encode.py's Triton encoders (`int_rows`, `fp8_tokens`,
// `fp16_tokens`, `kivi_window`), which follow torch op by op: built WITHOUT --use_fast_math and with
// -fmad=false (library.py EXACT_FLAGS), IEEE division (__fdiv_rn), round half to even.
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
};

struct WritePlan {
  long long kind;   // 0 int, 1 fp8 e4m3, 2 fp8 e5m2, 3 fp16
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

__global__ void write_kernel(WritePlan p, const void* xk, const void* xv, int rowk, int rowv, int tokk, int tokv) {
  __shared__ float xs[MAX_D];
  __shared__ int qs[MAX_D];
  __shared__ float gs[MAX_D], gz[MAX_D];  // int: each group's scale and zero (fp16 values)
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
    const int NB = (D * BITS + 7) / 8;
    for (int j = lane; j < NB; j += 32) {  // byte j: the bits of every value overlapping it
      int acc = 0;
      const int i1 = min((8 * j + 7) / BITS, D - 1);
      for (int i = (8 * j) / BITS; i <= i1; ++i) {
        const int sh = i * BITS - 8 * j;
        acc |= (sh >= 0 ? qs[i] << sh : qs[i] >> -sh) & 0xFF;
      }
      w.c[co + j] = (uint8_t)acc;
    }
    bits = __any_sync(0xffffffffu, over) ? 2 : 0;
  } else if (p.kind <= 2) {  // fp8: step_encode `_fp8_kernel`
    const int M = p.kind == 1 ? 3 : 2, EMIN = p.kind == 1 ? -6 : -14;
    const float MAXV = p.kind == 1 ? 448.0f : 57344.0f;
    const float scale = w.hs[h];
    for (int e = lane; e < D; e += 32) w.c[co + e] = fp8_code(__fdiv_rn(xs[e], scale), M, EMIN, MAXV);
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

extern "C" int kvq_write_plan_size() { return (int)sizeof(WritePlan); }
extern "C" int kvq_write_max_d() { return MAX_D; }

// One layer's one-token write: xk, xv [B, H, 1, D] of the plan's dtype, at rows rowk / rowv of
// the two stores' token axes (a KIVI window's row: fp16 kind), flagged as tokens tokk / tokv.
// Launches only (no allocation, no synchronisation). (plan is a WritePlan*: a namespace-local
// type in the signature would hide the entry from ctypes.)
extern "C" int kvq_write_pair(const void* plan, const void* xk, const void* xv, int rowk, int rowv, int tokk,
                              int tokv, void* stream) {
  const WritePlan* p = static_cast<const WritePlan*>(plan);
  if (p->D < 1 || p->D > MAX_D || (p->kind == 0 && (p->G < 1 || p->D % p->G))) return (int)cudaErrorInvalidValue;
  write_kernel<<<dim3((unsigned)(p->B * p->H), 2), 32, 0, static_cast<cudaStream_t>(stream)>>>(*p, xk, xv, rowk, rowv,
                                                                                                tokk, tokv);
  return (int)cudaGetLastError();
}
