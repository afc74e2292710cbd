// The host AdamW in one pass over memory, for a tile's two float32-master layouts (fused_adamw.py).
//
// The arithmetic is torch's fused AdamW on the CPU (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
// ADAMW mode, float32), operation for operation, so the numbers are the same to the bit: the
// constants are made in double and rounded to float as there; a call's elements up to its last
// multiple of torch's vector width (`body`) take its vector formula and the rest its scalar one.
// Which products and sums are one fused multiply-add is what torch's released build does, and that
// may differ between builds and vector widths (its compiler contracts some of them: the second
// moment's, the lerp's, perhaps the weight decay's product into the step's sum; torch 2.11's
// AVX-512 build's scalar formula gives a second moment that none of the forms here gives). So
// each is written out here in every form a build may take, with nothing else contracted
// (-ffp-contract=off), and the call's `form` picks one of each: fused_adamw.py finds the forms
// that give torch's own kernel's numbers to the bit on the machine that runs it, and where none
// does leaves those elements to torch.
//
// Called through ctypes, which releases the GIL for the call: the optimizer worker runs this while
// the main thread launches the GPU's work. OpenMP threads: `threads`, the caller's torch count.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <type_traits>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

struct Step {
  float decay;      // 1 - lr * weight_decay where weight_decay != 0, else 1 (p * 1 is p, to the bit)
  float weight;     // 1 - beta1: exp_avg.lerp_(grad, weight)
  bool small;       // |weight| < 0.5: the lerp starts from exp_avg, else from grad
  uint32_t from_m;  // all ones where small: the vector lerp's base, exp_avg's bits, else grad's
  float coeff;      // the vector lerp's factor: weight, or weight - 1
  float beta2, one_minus_beta2, bias_correction2_sqrt, eps, step_size;
  float grad_scale; // 1 where the gradient is not scaled (g * 1 is g)
  // the forms (`form`'s fields, set_forms), each as masks of all ones on the chosen one, so that
  // the choice is a select the loops vectorise: the vector second moment's three, the vector
  // lerp's two, the vector step's two, and the scalar formula's likewise
  uint32_t vv[3], vm[2], vp[2], sv[3], sm[2], sp[2];
};

// `form`: bits 0-1 the vector second moment (0: fma(c g, g, v b2); 1: fma(v, b2, c g g); 2:
// neither fused), bit 2 the vector lerp (0: fused; 1: not), bits 3-4 the scalar second moment
// (as bits 0-1), bit 5 the scalar lerp (0: fused; 1: not), bit 6 the vector step (0: the decayed
// master plus the step; 1: fma(p, decay, step)), bit 7 the scalar step (as bit 6)
void set_forms(Step& s, int form) {
  for (int k = 0; k < 3; ++k) {
    s.vv[k] = (form & 3) == k ? ~0u : 0u;
    s.sv[k] = ((form >> 3) & 3) == k ? ~0u : 0u;
  }
  for (int k = 0; k < 2; ++k) {
    s.vm[k] = ((form >> 2) & 1) == k ? ~0u : 0u;
    s.sm[k] = ((form >> 5) & 1) == k ? ~0u : 0u;
    s.vp[k] = ((form >> 6) & 1) == k ? ~0u : 0u;
    s.sp[k] = ((form >> 7) & 1) == k ? ~0u : 0u;
  }
}

Step make_step(double step, double lr, double beta1, double beta2, double weight_decay, double eps,
               double grad_scale, int form) {
  Step s;
  set_forms(s, form);
  double bias_correction1 = 1 - std::pow(beta1, step);
  double bias_correction2 = 1 - std::pow(beta2, step);
  s.decay = weight_decay != 0.f ? float(1 - lr * weight_decay) : 1.0f;
  s.weight = float(1 - beta1);
  s.small = std::abs(s.weight) < 0.5f;
  s.coeff = s.small ? s.weight : s.weight - 1.0f;
  s.from_m = s.small ? ~0u : 0u;
  s.beta2 = float(beta2);
  s.one_minus_beta2 = float(1 - beta2);
  s.bias_correction2_sqrt = float(std::sqrt(bias_correction2));
  s.eps = float(eps);
  s.step_size = float(lr / bias_correction1);
  s.grad_scale = float(grad_scale);
  return s;
}

inline uint32_t bits(float x) { return __builtin_bit_cast(uint32_t, x); }
inline float from_bits(uint32_t b) { return __builtin_bit_cast(float, b); }

inline float grad_at(const float* g, int64_t i) { return g[i]; }
inline float grad_at(const uint16_t* g, int64_t i) {  // bf16: its float is exact
  return __builtin_bit_cast(float, uint32_t(g[i]) << 16);
}

inline float pick(const uint32_t* masks, float a, float b) {
  return from_bits((bits(a) & masks[0]) | (bits(b) & masks[1]));
}
inline float pick(const uint32_t* masks, float a, float b, float c) {
  return from_bits((bits(a) & masks[0]) | (bits(b) & masks[1]) | (bits(c) & masks[2]));
}

// the second moment, v * beta2 + (1 - beta2) * g * g, in the form `masks` picks
inline float second_moment(float v, float g, const Step& s, const uint32_t* masks) {
  float cg = s.one_minus_beta2 * g;
  return pick(masks, std::fma(cg, g, v * s.beta2), std::fma(v, s.beta2, cg * g), v * s.beta2 + cg * g);
}

// torch's vector formula: the lerp is fmadd(coeff, grad - exp_avg, base) (the base picked by a
// mask: a select on a scalar flag does not vectorise)
inline void vector_update(float& p, float g, float& m, float& v, const Step& s) {
  float base = from_bits((bits(m) & s.from_m) | (bits(g) & ~s.from_m));
  m = pick(s.vm, std::fma(s.coeff, g - m, base), s.coeff * (g - m) + base);
  v = second_moment(v, g, s, s.vv);
  float denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
  float step = (-s.step_size) * m / denom;
  p = pick(s.vp, p * s.decay + step, std::fma(p, s.decay, step));
}

// torch's scalar formula, for the elements past a call's last full vector
inline void scalar_update(float& p, float g, float& m, float& v, const Step& s) {
  float d = g - m;
  m = s.small ? pick(s.sm, std::fma(s.weight, d, m), m + s.weight * d)
              : pick(s.sm, std::fma(-d, 1.0f - s.weight, g), g - d * (1.0f - s.weight));
  v = second_moment(v, g, s, s.sv);
  float denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
  float step = s.step_size * m / denom;
  p = pick(s.sp, p * s.decay - step, std::fma(p, s.decay, -step));
}

// float32 bits to bf16, round to nearest even (c10::BFloat16's; a NaN becomes the quiet one)
inline uint16_t to_bf16(uint32_t b) {
  uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return uint16_t((b & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

constexpr uint32_t SIGN = 0x80000000u;
constexpr int16_t TIE = -32768;  // a low half halfway between two bf16 values (store.py)

// Elements [0, n) of one thread's range, the vector formula up to `body`. Plain loops over
// restrict pointers with the step's constants by value: the compiler vectorises them.
template <typename G>
void whole_range(float* __restrict p, const G* __restrict g, float* __restrict m, float* __restrict v, int64_t n,
                 int64_t body, const Step s) {
  for (int64_t i = 0; i < body; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    vector_update(pi, grad_at(g, i) * s.grad_scale, mi, vi, s);
    p[i] = pi, m[i] = mi, v[i] = vi;
  }
  for (int64_t i = body; i < n; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    scalar_update(pi, grad_at(g, i) * s.grad_scale, mi, vi, s);
    p[i] = pi, m[i] = mi, v[i] = vi;
  }
}

// store.join (take=True), the update, store.split, element by element: the master is the shadow's
// bits, the sign-extended low half added, and 2^16 more where the low half is TIE and exp_avg_sq's
// sign flags it; the flag is cleared for the update and set again where the new master is a TIE
// rounded down. Branch-free, so that the loop vectorises.
template <bool VECTOR, typename G>
inline void split_one(uint16_t* __restrict shadow, int16_t* __restrict low, const G* __restrict g,
                      float* __restrict m, float* __restrict v, int64_t i, const Step& s) {
  int16_t lo = low[i];
  uint32_t vb = bits(v[i]);
  bool tie = lo == TIE;
  uint32_t master = (uint32_t(shadow[i]) << 16) + uint32_t(int32_t(lo)) + (tie ? (vb >> 31) << 16 : 0u);
  vb = tie ? vb & ~SIGN : vb;
  float pi = from_bits(master), mi = m[i], vi = from_bits(vb);
  float gi = grad_at(g, i) * s.grad_scale;
  if (VECTOR) vector_update(pi, gi, mi, vi, s); else scalar_update(pi, gi, mi, vi, s);
  uint32_t b = bits(pi);
  uint16_t high = to_bf16(b);
  int16_t new_low = int16_t(b & 0xFFFFu);
  uint32_t down = (b & 0xFFFF0000u) == (uint32_t(high) << 16);
  uint32_t nvb = bits(vi);
  nvb = new_low == TIE ? (nvb & ~SIGN) | (down << 31) : nvb;
  shadow[i] = high;
  low[i] = new_low;
  m[i] = mi;
  v[i] = from_bits(nvb);
}

template <typename G>
void split_range(uint16_t* __restrict shadow, int16_t* __restrict low, const G* __restrict g, float* __restrict m,
                 float* __restrict v, int64_t n, int64_t body, const Step s) {
  for (int64_t i = 0; i < body; ++i) split_one<true>(shadow, low, g, m, v, i, s);
  for (int64_t i = body; i < n; ++i) split_one<false>(shadow, low, g, m, v, i, s);
}

// `fn(lo, hi, body_in_range)` on `threads` threads, each a contiguous range of [0, n), its bounds
// multiples of 16 elements (whole cache lines of floats)
template <typename Fn>
void in_parallel(int64_t n, int64_t body, int threads, Fn fn) {
  int64_t units = (n + 15) / 16;
  if (threads < 1) threads = 1;
  if (units < threads) threads = int(units > 0 ? units : 1);
#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    int t = omp_get_thread_num(), team = omp_get_num_threads();
#else
    int t = 0, team = 1;
#endif
    int64_t lo = std::min(n, units * t / team * 16), hi = std::min(n, units * (t + 1) / team * 16);
    if (lo < hi) fn(lo, hi, std::max(lo, std::min(hi, body)));
  }
}

}  // namespace

extern "C" {

// A whole float32 master `p` and its moments; `grad` float32, or bf16 where `grad_bf16`.
void megatrain_adamw_whole(float* p, const void* grad, float* m, float* v, int64_t n, int64_t body, double step,
                           double lr, double beta1, double beta2, double weight_decay, double eps, double grad_scale,
                           int grad_bf16, int threads, int form) {
  const Step s = make_step(step, lr, beta1, beta2, weight_decay, eps, grad_scale, form);
  in_parallel(n, body, threads, [&](int64_t lo, int64_t hi, int64_t b) {
    if (grad_bf16) whole_range(p + lo, static_cast<const uint16_t*>(grad) + lo, m + lo, v + lo, hi - lo, b - lo, s);
    else whole_range(p + lo, static_cast<const float*>(grad) + lo, m + lo, v + lo, hi - lo, b - lo, s);
  });
}

// A split master: `shadow` (bf16 bits, its high half), `low` (its low 16 bits), the flags in the
// sign of `v` (store.py).
void megatrain_adamw_split(uint16_t* shadow, int16_t* low, const void* grad, float* m, float* v, int64_t n,
                           int64_t body, double step, double lr, double beta1, double beta2, double weight_decay,
                           double eps, double grad_scale, int grad_bf16, int threads, int form) {
  const Step s = make_step(step, lr, beta1, beta2, weight_decay, eps, grad_scale, form);
  in_parallel(n, body, threads, [&](int64_t lo, int64_t hi, int64_t b) {
    if (grad_bf16) split_range(shadow + lo, low + lo, static_cast<const uint16_t*>(grad) + lo, m + lo, v + lo,
                               hi - lo, b - lo, s);
    else split_range(shadow + lo, low + lo, static_cast<const float*>(grad) + lo, m + lo, v + lo, hi - lo, b - lo, s);
  });
}

}
