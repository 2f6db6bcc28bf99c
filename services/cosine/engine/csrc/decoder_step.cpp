// Every decoder layer of a decode or verify step in one call: norms, q/k/v, RoPE, the cache writes, attention,
// output projection, SwiGLU and the residuals, on CoSine's matmul and attention kernels.
//
// Why: the same layers through TorchScript are some 40 small ATen ops per layer around the matmuls, each a
// dispatch and an allocation; on the 135M target (30 layers) those cost about a quarter of a bf16 decode step on
// 2 cores. Here the small ops are loops over each row's own elements (no row's numbers depend on another row,
// the thread or the batch), and the matmuls and attention are called directly.
//
// Arithmetic (fp32, or bf16 rounded where the TorchScript layers round):
//   rms(x) = bf16(x * 1/sqrt(mean(x^2) + eps)) * w   (sum of squares in 16 lanes, then one fixed horizontal sum)
//   rope(t) = t * cos + rotate_half(t) * sin          (sin already signed for rotate_half; rounded once)
//   swiglu(g, u) = bf16(g * sigmoid(g)) * u           (the polynomial exp of cosine_kernels.h)
#include <ATen/Parallel.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cosine_kernels.h"

namespace {

using cosine::exp16;
using cosine::load16;

__attribute__((target("avx512f"))) inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
__attribute__((target("avx512f,avx512bf16"))) inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v));
}
// round to the storage type and back (the rounding the TorchScript layers do between two ops)
__attribute__((target("avx512f"))) inline __m512 round_to(__m512 v, const float*) { return v; }
__attribute__((target("avx512f,avx512bf16"))) inline __m512 round_to(__m512 v, const c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// out[m] = rms(x[m]) * w for rows [m0, m1), H a multiple of 16
template <typename T>
__attribute__((target("avx512f,avx512bf16"))) void rms_rows(const T* x, const T* w, T* out, int64_t m0, int64_t m1,
                                                           int64_t H, float eps) {
    for (int64_t m = m0; m < m1; m++) {
      const T* xr = x + m * H;
      __m512 ss = _mm512_setzero_ps();
      for (int64_t i = 0; i < H; i += 16) {
        const __m512 v = load16(xr + i);
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / (float)H + eps);
      const __m512 rv = _mm512_set1_ps(r);
      for (int64_t i = 0; i < H; i += 16) {
        const __m512 y = round_to(_mm512_mul_ps(load16(xr + i), rv), (const T*)nullptr);
        store16(out + m * H + i, _mm512_mul_ps(y, load16(w + i)));
      }
    }
}

template <typename T>
void rms(const T* x, const T* w, T* out, int64_t M, int64_t H, float eps) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) { rms_rows<T>(x, w, out, m0, m1, H, eps); });
}

// a[m] = bf16(g * sigmoid(g)) * u for rows [m0, m1), gu [M, 2 * inter] = (g, u)
template <typename T>
__attribute__((target("avx512f,avx512bf16"))) void swiglu_rows(const T* gu, T* a, int64_t m0, int64_t m1,
                                                              int64_t inter) {
  for (int64_t m = m0; m < m1; m++)
    for (int64_t i = 0; i < inter; i += 16) {
      const __m512 g = load16(gu + m * 2 * inter + i);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
      const __m512 s = round_to(_mm512_mul_ps(g, sig), (const T*)nullptr);
      store16(a + m * inter + i, _mm512_mul_ps(s, load16(gu + m * 2 * inter + inter + i)));
    }
}

// RoPE of one head: dst = src * cos + roll(src, hd/2) * sin (16 lanes at a time where hd/2 is a multiple of 16)
template <typename T>
__attribute__((target("avx512f,avx512bf16"))) inline void rope(const T* src, const T* cos, const T* sin, T* dst,
                                                              int64_t hd) {
  const int64_t half = hd / 2;
  if (half % 16) {
    for (int64_t i = 0; i < hd; i++) {
      const int64_t j = i < half ? i + half : i - half;
      const float a = (float)src[i] * (float)cos[i];
      dst[i] = static_cast<T>(std::fma((float)src[j], (float)sin[i], a));
    }
    return;
  }
  for (int64_t i = 0; i < hd; i += 16) {
    const int64_t j = i < half ? i + half : i - half;  // roll by half: element i takes src[i - half]
    const __m512 a = _mm512_mul_ps(load16(src + i), load16(cos + i));
    store16(dst + i, _mm512_fmadd_ps(load16(src + j), load16(sin + i), a));
  }
}

template <typename T>
at::Tensor step(const at::Tensor& x0, at::TensorList ln1, at::TensorList ln2, at::TensorList qkv_w,
                const c10::List<c10::optional<at::Tensor>>& qkv_b, at::TensorList o_w,
                const c10::List<c10::optional<at::Tensor>>& o_b, at::TensorList gate_up_w,
                const c10::List<c10::optional<at::Tensor>>& gate_up_b, at::TensorList down_w,
                const c10::List<c10::optional<at::Tensor>>& down_b, const at::Tensor& cache_k,
                const at::Tensor& cache_v, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_index,
                const at::Tensor& slots, const at::Tensor& prefix, const at::Tensor& offsets, const at::Tensor& index,
                int64_t nh, int64_t nkv, int64_t hd, int64_t inter, double eps, double scale) {
  const int64_t N = x0.size(0), H = x0.size(1), qsz = nh * hd, kvsz = nkv * hd, width = qsz + 2 * kvsz;
  const int64_t per_layer = cache_k[0].numel();
  const int64_t* kvi = kv_index.data_ptr<int64_t>();
  const T* cs = (const T*)cos.data_ptr();
  const T* sn = (const T*)sin.data_ptr();
  at::Tensor x = x0.contiguous();
  at::Tensor h = at::empty({N, H}, x.options());
  at::Tensor q = at::empty({N, nh, hd}, x.options());
  at::Tensor a = at::empty({N, inter}, x.options());
  for (size_t li = 0; li < ln1.size(); li++) {
    rms<T>((const T*)x.data_ptr(), (const T*)ln1[li].data_ptr(), (T*)h.data_ptr(), N, H, (float)eps);
    const at::Tensor qkv = cosine::packed_linear(h, qkv_w[li], qkv_b.get(li), c10::nullopt);
    T* kc = (T*)cache_k.data_ptr() + li * per_layer;
    T* vc = (T*)cache_v.data_ptr() + li * per_layer;
    const T* qkvp = (const T*)qkv.data_ptr();
    T* qp = (T*)q.data_ptr();
    for (int64_t n = 0; n < N; n++) {
      const T* row = qkvp + n * width;
      for (int64_t hh = 0; hh < nh; hh++) rope<T>(row + hh * hd, cs + n * hd, sn + n * hd, qp + (n * nh + hh) * hd, hd);
      for (int64_t g = 0; g < nkv; g++) {
        const int64_t at = kvi[n * nkv + g];
        rope<T>(row + qsz + g * hd, cs + n * hd, sn + n * hd, kc + at * hd, hd);
        std::memcpy(vc + at * hd, row + qsz + kvsz + g * hd, hd * sizeof(T));
      }
    }
    const at::Tensor o = cosine::attention_rows(q, cache_k[li], cache_v[li], slots, prefix, offsets, index, scale);
    x = cosine::packed_linear(o, o_w[li], o_b.get(li), x);
    rms<T>((const T*)x.data_ptr(), (const T*)ln2[li].data_ptr(), (T*)h.data_ptr(), N, H, (float)eps);
    const at::Tensor gu = cosine::packed_linear(h, gate_up_w[li], gate_up_b.get(li), c10::nullopt);
    const T* gup = (const T*)gu.data_ptr();
    T* ap = (T*)a.data_ptr();
    at::parallel_for(0, N, 8, [&](int64_t m0, int64_t m1) { swiglu_rows<T>(gup, ap, m0, m1, inter); });
    x = cosine::packed_linear(a, down_w[li], down_b.get(li), x);
  }
  return x;
}

at::Tensor decoder_step(const at::Tensor& x, at::TensorList ln1, at::TensorList ln2, at::TensorList qkv_w,
                        const c10::List<c10::optional<at::Tensor>>& qkv_b, at::TensorList o_w,
                        const c10::List<c10::optional<at::Tensor>>& o_b, at::TensorList gate_up_w,
                        const c10::List<c10::optional<at::Tensor>>& gate_up_b, at::TensorList down_w,
                        const c10::List<c10::optional<at::Tensor>>& down_b, const at::Tensor& cache_k,
                        const at::Tensor& cache_v, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& kv_index, const at::Tensor& slots, const at::Tensor& prefix,
                        const at::Tensor& offsets, const at::Tensor& index, int64_t nh, int64_t nkv, int64_t hd,
                        int64_t inter, double eps, double scale) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && (dt == at::kFloat || (dt == at::kBFloat16 &&
                                                                          __builtin_cpu_supports("avx512bf16"))),
              "cosine::decoder_step: float32 on AVX-512 or bfloat16 on AVX512-BF16");
  const size_t L = ln1.size();
  TORCH_CHECK(ln2.size() == L && qkv_w.size() == L && qkv_b.size() == L && o_w.size() == L && o_b.size() == L &&
                  gate_up_w.size() == L && gate_up_b.size() == L && down_w.size() == L && down_b.size() == L,
              "cosine::decoder_step: one of each weight per layer");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 16 == 0 && hd % 16 == 0 && inter % 16 == 0,
              "cosine::decoder_step: hidden, intermediate and head sizes multiples of 16");
  const int64_t N = x.size(0);
  TORCH_CHECK(cache_k.dim() == 5 && cache_k.is_contiguous() && cache_v.is_contiguous() &&
                  cache_k.sizes() == cache_v.sizes() && cache_k.size(0) == (int64_t)L && cache_k.size(2) == nkv &&
                  cache_k.size(4) == hd && cache_k.scalar_type() == dt && cache_v.scalar_type() == dt,
              "cosine::decoder_step: caches [layers, slots, kv_heads, max_len, head_dim], contiguous, x's dtype");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == N && cos.size(1) == hd && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                  sin.is_contiguous() && cos.scalar_type() == dt && sin.scalar_type() == dt,
              "cosine::decoder_step: cos and sin [N, head_dim], contiguous, x's dtype");
  TORCH_CHECK(kv_index.dim() == 1 && kv_index.numel() == N * nkv && kv_index.scalar_type() == at::kLong &&
                  kv_index.is_contiguous(),
              "cosine::decoder_step: kv_index [N * kv_heads] int64");
  const int64_t rows = cache_k[0].numel() / hd;
  const int64_t* kvi = kv_index.data_ptr<int64_t>();
  for (int64_t i = 0; i < N * nkv; i++)
    TORCH_CHECK(kvi[i] >= 0 && kvi[i] < rows, "cosine::decoder_step: kv_index out of the cache");
  for (size_t li = 0; li < L; li++)
    TORCH_CHECK(ln1[li].scalar_type() == dt && ln1[li].is_contiguous() && ln1[li].numel() == x.size(1) &&
                    ln2[li].scalar_type() == dt && ln2[li].is_contiguous() && ln2[li].numel() == x.size(1),
                "cosine::decoder_step: norms [hidden] in x's dtype");
  if (dt == at::kFloat)
    return step<float>(x, ln1, ln2, qkv_w, qkv_b, o_w, o_b, gate_up_w, gate_up_b, down_w, down_b, cache_k, cache_v,
                       cos, sin, kv_index, slots, prefix, offsets, index, nh, nkv, hd, inter, eps, scale);
  return step<c10::BFloat16>(x, ln1, ln2, qkv_w, qkv_b, o_w, o_b, gate_up_w, gate_up_b, down_w, down_b, cache_k,
                             cache_v, cos, sin, kv_index, slots, prefix, offsets, index, nh, nkv, hd, inter, eps, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cosine, m) {
  m.def("decoder_step(Tensor x, Tensor[] ln1, Tensor[] ln2, Tensor[] qkv_w, Tensor?[] qkv_b, Tensor[] o_w, "
        "Tensor?[] o_b, Tensor[] gate_up_w, Tensor?[] gate_up_b, Tensor[] down_w, Tensor?[] down_b, Tensor cache_k, "
        "Tensor cache_v, Tensor cos, Tensor sin, Tensor kv_index, Tensor slots, Tensor prefix, Tensor offsets, "
        "Tensor index, int nh, int nkv, int hd, int intermediate, float eps, float scale) -> Tensor",
        decoder_step);
}
