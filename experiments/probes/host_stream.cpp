// STREAM's copy (a = b) and triad (a = b + s c) on float32 arrays, on `threads` OpenMP threads, each
// a static share of whole 64-byte lines; `nt` writes `a` with non-temporal stores (AVX-512 or AVX),
// so its lines are not read before they are written (STREAM's byte counts assume no such read);
// elsewhere (no x86 vector extension) plain stores either way. Built and timed by adamw_rate.py.
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {
constexpr int64_t LINE = 16;  // floats in a 64-byte line

inline void put(float* a, int64_t i, const float* v, bool nt) {
#if defined(__AVX512F__)
    __m512 x = _mm512_loadu_ps(v);
    if (nt) _mm512_stream_ps(a + i, x); else _mm512_storeu_ps(a + i, x);
#elif defined(__AVX__)
    __m256 x0 = _mm256_loadu_ps(v), x1 = _mm256_loadu_ps(v + 8);
    if (nt) { _mm256_stream_ps(a + i, x0); _mm256_stream_ps(a + i + 8, x1); }
    else { _mm256_storeu_ps(a + i, x0); _mm256_storeu_ps(a + i + 8, x1); }
#else
    (void)nt;
    for (int k = 0; k < LINE; ++k) a[i + k] = v[k];
#endif
}

template <typename F>
void lines(float* a, int64_t n, int threads, bool nt, F value) {
    // a's first line boundary: the lines before it and the tail after the last whole line plainly
    int64_t head = (64 - (reinterpret_cast<uintptr_t>(a) & 63)) % 64 / sizeof(float);
    if (head > n) head = n;
    for (int64_t i = 0; i < head; ++i) a[i] = value(i);
    int64_t body = head + (n - head) / LINE * LINE;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = head; i < body; i += LINE) {
        alignas(64) float v[LINE];
        for (int k = 0; k < LINE; ++k) v[k] = value(i + k);
        put(a, i, v, nt);
    }
    for (int64_t i = body; i < n; ++i) a[i] = value(i);
#if defined(__x86_64__)
    if (nt) _mm_sfence();
#endif
}
}  // namespace

extern "C" {
void host_stream_copy(float* a, const float* b, int64_t n, int threads, int nt) {
    lines(a, n, threads, nt, [=](int64_t i) { return b[i]; });
}

void host_stream_triad(float* a, const float* b, const float* c, float s, int64_t n, int threads, int nt) {
    lines(a, n, threads, nt, [=](int64_t i) { return b[i] + s * c[i]; });
}
}
