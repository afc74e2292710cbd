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
// does leaves those elements to torch. The vector formula's forms are template arguments, a loop
// compiled for each, so that the loop computes the picked one alone (a select among all of them
// cost the loop 36 instructions a vector where it needs 21-24); the scalar formula's, which takes
// fewer than a vector's elements a call, are selects.
//
// Called through ctypes, which releases the GIL for the call: the optimizer worker runs this while
// the main thread launches the GPU's work. OpenMP threads: `threads`, the caller's torch count.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <type_traits>
#if defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define MEGATRAIN_SPLIT_AVX512 1
#endif
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
  // the scalar formula's forms (`form`'s fields, set_forms), each as masks of all ones on the
  // chosen one, so that the choice is a select: its second moment's three, its lerp's two, its
  // step's two (the vector formula's are template arguments: VectorForm)
  uint32_t sv[3], sm[2], sp[2];
};

// The vector formula's forms, `form`'s bits 0-1 (the second moment), 2 (the lerp) and 6 (the
// step): fixed where the loop is compiled, so that it computes the chosen form alone.
template <int FORM>
struct VectorForm {
  static constexpr int moment = FORM & 3;
  static constexpr bool lerp_fused = ((FORM >> 2) & 1) == 0;
  static constexpr bool step_fused = ((FORM >> 6) & 1) == 1;
};

// `form`: bits 0-1 the vector second moment (0: fma(c g, g, v b2); 1: fma(v, b2, c g g); 2:
// neither fused), bit 2 the vector lerp (0: fused; 1: not), bits 3-4 the scalar second moment
// (as bits 0-1), bit 5 the scalar lerp (0: fused; 1: not), bit 6 the vector step (0: the decayed
// master plus the step; 1: fma(p, decay, step)), bit 7 the scalar step (as bit 6)
void set_forms(Step& s, int form) {
  for (int k = 0; k < 3; ++k) s.sv[k] = ((form >> 3) & 3) == k ? ~0u : 0u;
  for (int k = 0; k < 2; ++k) {
    s.sm[k] = ((form >> 5) & 1) == k ? ~0u : 0u;
    s.sp[k] = ((form >> 7) & 1) == k ? ~0u : 0u;
  }
}

// `fn(VectorForm<F>{})` for the vector form `form` names (its bits 0-2 and 6; 3 second moments x
// 2 lerps x 2 steps)
template <typename Fn>
void with_vector_form(int form, Fn fn) {
  switch (form & 0b1000111) {
    case 0: return fn(VectorForm<0>{});
    case 1: return fn(VectorForm<1>{});
    case 2: return fn(VectorForm<2>{});
    case 4: return fn(VectorForm<4>{});
    case 5: return fn(VectorForm<5>{});
    case 6: return fn(VectorForm<6>{});
    case 64: return fn(VectorForm<64>{});
    case 65: return fn(VectorForm<65>{});
    case 66: return fn(VectorForm<66>{});
    case 68: return fn(VectorForm<68>{});
    case 69: return fn(VectorForm<69>{});
    default: return fn(VectorForm<70>{});
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

// the second moment, v * beta2 + (1 - beta2) * g * g, in form `moment` (0: fma(c g, g, v b2);
// 1: fma(v, b2, c g g); 2: neither fused)
template <int moment>
inline float second_moment(float v, float g, const Step& s) {
  float cg = s.one_minus_beta2 * g;
  if constexpr (moment == 0) return std::fma(cg, g, v * s.beta2);
  else if constexpr (moment == 1) return std::fma(v, s.beta2, cg * g);
  else return v * s.beta2 + cg * g;
}

// the second moment in the form `masks` picks (the scalar formula's)
inline float second_moment(float v, float g, const Step& s, const uint32_t* masks) {
  return pick(masks, second_moment<0>(v, g, s), second_moment<1>(v, g, s), second_moment<2>(v, g, s));
}

// torch's vector formula in form F: the lerp is fmadd(coeff, grad - exp_avg, base) (the base
// picked by a mask: a select on a scalar flag does not vectorise)
template <typename F>
inline void vector_update(float& p, float g, float& m, float& v, const Step& s) {
  float base = from_bits((bits(m) & s.from_m) | (bits(g) & ~s.from_m));
  if constexpr (F::lerp_fused) m = std::fma(s.coeff, g - m, base);
  else m = s.coeff * (g - m) + base;
  v = second_moment<F::moment>(v, g, s);
  float denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
  float step = (-s.step_size) * m / denom;
  if constexpr (F::step_fused) p = std::fma(p, s.decay, step);
  else p = p * s.decay + step;
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

// The scalar formula's place among the forms: a loop compiled with it takes a call's tail.
struct ScalarForm {};

template <typename F>
inline void update(float& p, float g, float& m, float& v, const Step& s) {
  if constexpr (std::is_same_v<F, ScalarForm>) scalar_update(p, g, m, v, s);
  else vector_update<F>(p, g, m, v, s);
}

// Elements [from, to) of a whole master in form F (a vector form, or ScalarForm). Plain loops over
// restrict pointers with the step's constants by value: the compiler vectorises them. The tail's
// loop is compiled once, not once per vector form.
template <typename F, typename G>
void whole_loop(float* __restrict p, const G* __restrict g, float* __restrict m, float* __restrict v, int64_t from,
                int64_t to, const Step s) {
  for (int64_t i = from; i < to; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    update<F>(pi, grad_at(g, i) * s.grad_scale, mi, vi, s);
    p[i] = pi, m[i] = mi, v[i] = vi;
  }
}

// store.join (take=True), the update, store.split, element by element: the master is the shadow's
// bits, the sign-extended low half added, and 2^16 more where the low half is TIE and exp_avg_sq's
// sign flags it; the flag is cleared for the update and set again where the new master is a TIE
// rounded down. Branch-free, so that the loop vectorises.
template <typename F, typename G>
inline void split_one(uint16_t* __restrict shadow, int16_t* __restrict low, const G* __restrict g,
                      float* __restrict m, float* __restrict v, int64_t i, const Step& s) {
  int16_t lo = low[i];
  uint32_t vb = bits(v[i]);
  bool tie = lo == TIE;
  uint32_t master = (uint32_t(shadow[i]) << 16) + uint32_t(int32_t(lo)) + (tie ? (vb >> 31) << 16 : 0u);
  vb = tie ? vb & ~SIGN : vb;
  float pi = from_bits(master), mi = m[i], vi = from_bits(vb);
  update<F>(pi, grad_at(g, i) * s.grad_scale, mi, vi, s);
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

#ifdef MEGATRAIN_SPLIT_AVX512
// The same for 32 elements in AVX-512 registers: the halves joined and split in 16-bit lanes, 32 to
// a register, where the compiler's loop widens each to 32 bits first. The master's high half is
// shadow - (low < 0) + flag (mod 2^16) beside the low half's bits, which is the sum above; the
// arithmetic of the update is vector_update's, operation for operation.
struct Lanes {  // 16-bit lane indices of permutex2var: two registers' halves interleaved, or picked
  __m512i even_first, even_second, low_halves, high_halves;
  Lanes() {
    alignas(64) uint16_t a[32], b[32], c[32], d[32];
    for (int j = 0; j < 16; ++j) {
      a[2 * j] = j, a[2 * j + 1] = 32 + j;        // (lo_j, hi_j) for j < 16: 32-bit words of elements 0-15
      b[2 * j] = 16 + j, b[2 * j + 1] = 48 + j;   // elements 16-31
      c[j] = 2 * j, c[16 + j] = 32 + 2 * j;       // the low halves of two registers' 32-bit words
      d[j] = 2 * j + 1, d[16 + j] = 33 + 2 * j;   // the high halves
    }
    even_first = _mm512_load_si512(a), even_second = _mm512_load_si512(b);
    low_halves = _mm512_load_si512(c), high_halves = _mm512_load_si512(d);
  }
};

struct Broadcast {  // the step's constants in registers, made once a call
  __m512 coeff, beta2, one_minus_beta2, bias_correction2_sqrt, eps, minus_step_size, decay, grad_scale;
  bool small;
  explicit Broadcast(const Step& s)
      : coeff(_mm512_set1_ps(s.coeff)), beta2(_mm512_set1_ps(s.beta2)), one_minus_beta2(_mm512_set1_ps(s.one_minus_beta2)),
        bias_correction2_sqrt(_mm512_set1_ps(s.bias_correction2_sqrt)), eps(_mm512_set1_ps(s.eps)),
        minus_step_size(_mm512_set1_ps(-s.step_size)), decay(_mm512_set1_ps(s.decay)),
        grad_scale(_mm512_set1_ps(s.grad_scale)), small(s.small) {}
};

template <typename F>
inline void vector_update16(__m512& p, __m512 g, __m512& m, __m512& v, const Broadcast& c) {
  __m512 base = c.small ? m : g;
  __m512 d = _mm512_sub_ps(g, m);
  m = F::lerp_fused ? _mm512_fmadd_ps(c.coeff, d, base) : _mm512_add_ps(_mm512_mul_ps(c.coeff, d), base);
  __m512 cg = _mm512_mul_ps(c.one_minus_beta2, g);
  if constexpr (F::moment == 0) v = _mm512_fmadd_ps(cg, g, _mm512_mul_ps(v, c.beta2));
  else if constexpr (F::moment == 1) v = _mm512_fmadd_ps(v, c.beta2, _mm512_mul_ps(cg, g));
  else v = _mm512_add_ps(_mm512_mul_ps(v, c.beta2), _mm512_mul_ps(cg, g));
  __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), c.bias_correction2_sqrt), c.eps);
  __m512 step = _mm512_div_ps(_mm512_mul_ps(c.minus_step_size, m), denom);
  p = F::step_fused ? _mm512_fmadd_ps(p, c.decay, step) : _mm512_add_ps(_mm512_mul_ps(p, c.decay), step);
}

inline __m512 grads16(const float* g, int64_t i, int half, const Lanes&) { return _mm512_loadu_ps(g + i + 16 * half); }
inline __m512 grads16(const uint16_t* g, int64_t i, int half, const Lanes& lanes) {  // bf16 to the float it is
  __m512i raw = _mm512_loadu_si512(g + i);
  return _mm512_castsi512_ps(_mm512_permutex2var_epi16(_mm512_setzero_si512(),
                                                       half ? lanes.even_second : lanes.even_first, raw));
}

template <typename F, typename G>
inline void split32(uint16_t* __restrict shadow, int16_t* __restrict low, const G* __restrict g,
                    float* __restrict m, float* __restrict v, int64_t i, const Broadcast& c, const Lanes& lanes) {
  const __m512i tie16 = _mm512_set1_epi16(TIE), sign = _mm512_set1_epi32(int(SIGN)),
                no_sign = _mm512_set1_epi32(int(~SIGN));
  __m512i lo = _mm512_loadu_si512(low + i), sh = _mm512_loadu_si512(shadow + i);
  __m512i vw[2] = {_mm512_loadu_si512(v + i), _mm512_loadu_si512(v + i + 16)};
  __mmask32 tie = _mm512_cmpeq_epi16_mask(lo, tie16);
  __mmask32 flagged = _mm512_kunpackw(_mm512_movepi32_mask(vw[1]), _mm512_movepi32_mask(vw[0]));
  __m512i high = _mm512_add_epi16(sh, _mm512_srai_epi16(lo, 15));
  high = _mm512_mask_add_epi16(high, tie & flagged, high, _mm512_set1_epi16(1));
  __m512i word[2] = {_mm512_permutex2var_epi16(lo, lanes.even_first, high),
                     _mm512_permutex2var_epi16(lo, lanes.even_second, high)};
  __m512i out[2];
  for (int h = 0; h < 2; ++h) {
    __mmask16 t = __mmask16(tie >> (16 * h));
    __m512 p = _mm512_castsi512_ps(word[h]), mm = _mm512_loadu_ps(m + i + 16 * h);
    __m512 vv = _mm512_castsi512_ps(_mm512_mask_and_epi32(vw[h], t, vw[h], no_sign));
    __m512 gg = _mm512_mul_ps(grads16(g, i, h, lanes), c.grad_scale);
    vector_update16<F>(p, gg, mm, vv, c);
    _mm512_storeu_ps(m + i + 16 * h, mm);
    vw[h] = _mm512_castps_si512(vv);
    out[h] = _mm512_castps_si512(p);
  }
  // store.split: the bf16 rounding (b + 0x7FFF + the kept bit's parity, its high half; a NaN the quiet one)
  const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1),
                abs = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
  __m512i rounded[2];
  __mmask16 nan[2];
  for (int h = 0; h < 2; ++h) {
    rounded[h] = _mm512_add_epi32(_mm512_add_epi32(out[h], half), _mm512_and_si512(_mm512_srli_epi32(out[h], 16), one));
    nan[h] = _mm512_cmpgt_epu32_mask(_mm512_and_si512(out[h], abs), inf);
  }
  __m512i new_high = _mm512_permutex2var_epi16(rounded[0], lanes.high_halves, rounded[1]);
  new_high = _mm512_mask_mov_epi16(new_high, _mm512_kunpackw(nan[1], nan[0]), _mm512_set1_epi16(0x7FC0));
  __m512i new_low = _mm512_permutex2var_epi16(out[0], lanes.low_halves, out[1]);
  __m512i top = _mm512_permutex2var_epi16(out[0], lanes.high_halves, out[1]);
  __mmask32 tie2 = _mm512_cmpeq_epi16_mask(new_low, tie16);
  __mmask32 down = tie2 & _mm512_cmpeq_epi16_mask(top, new_high);
  for (int h = 0; h < 2; ++h) {
    __mmask16 t = __mmask16(tie2 >> (16 * h)), d = __mmask16(down >> (16 * h));
    __m512i vv = _mm512_mask_and_epi32(vw[h], t, vw[h], no_sign);
    _mm512_storeu_si512(v + i + 16 * h, _mm512_mask_or_epi32(vv, d, vv, sign));
  }
  _mm512_storeu_si512(shadow + i, new_high);
  _mm512_storeu_si512(low + i, new_low);
}
#endif

template <typename F, typename G>
void split_loop(uint16_t* __restrict shadow, int16_t* __restrict low, const G* __restrict g, float* __restrict m,
                float* __restrict v, int64_t from, int64_t to, const Step s) {
  int64_t i = from;
#ifdef MEGATRAIN_SPLIT_AVX512
  if constexpr (!std::is_same_v<F, ScalarForm>) {
    static const Lanes lanes;
    const Broadcast c(s);
    for (; i + 32 <= to; i += 32) split32<F>(shadow, low, g, m, v, i, c, lanes);
  }
#endif
  for (; i < to; ++i) split_one<F>(shadow, low, g, m, v, i, s);
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
  with_vector_form(form, [&](auto f) {
    using F = decltype(f);
    in_parallel(n, body, threads, [&](int64_t lo, int64_t hi, int64_t b) {
      if (grad_bf16) {
        auto* g = static_cast<const uint16_t*>(grad);
        whole_loop<F>(p, g, m, v, lo, b, s);
        whole_loop<ScalarForm>(p, g, m, v, b, hi, s);
      } else {
        auto* g = static_cast<const float*>(grad);
        whole_loop<F>(p, g, m, v, lo, b, s);
        whole_loop<ScalarForm>(p, g, m, v, b, hi, s);
      }
    });
  });
}

// A split master: `shadow` (bf16 bits, its high half), `low` (its low 16 bits), the flags in the
// sign of `v` (store.py).
void megatrain_adamw_split(uint16_t* shadow, int16_t* low, const void* grad, float* m, float* v, int64_t n,
                           int64_t body, double step, double lr, double beta1, double beta2, double weight_decay,
                           double eps, double grad_scale, int grad_bf16, int threads, int form) {
  const Step s = make_step(step, lr, beta1, beta2, weight_decay, eps, grad_scale, form);
  with_vector_form(form, [&](auto f) {
    using F = decltype(f);
    in_parallel(n, body, threads, [&](int64_t lo, int64_t hi, int64_t b) {
      if (grad_bf16) {
        auto* g = static_cast<const uint16_t*>(grad);
        split_loop<F>(shadow, low, g, m, v, lo, b, s);
        split_loop<ScalarForm>(shadow, low, g, m, v, b, hi, s);
      } else {
        auto* g = static_cast<const float*>(grad);
        split_loop<F>(shadow, low, g, m, v, lo, b, s);
        split_loop<ScalarForm>(shadow, low, g, m, v, b, hi, s);
      }
    });
  });
}

}
