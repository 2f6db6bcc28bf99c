// CoSine's matmul for decode and verify steps on AVX-512 CPUs: y = x @ w.T (+ bias) (+ residual) in fp32 or
// bf16, every row's bits independent of the other rows of the call.
//
// Why: a step pushes 1 to a few hundred rows through every weight once. oneDNN's kernels give a row other
// last bits depending on how many rows share the call (bf16 on an AMD EPYC: the down projection, 2-4 of 64
// rows from 8 rows up), so a draft tree (many rows) and plain decoding (one row per request) could round to
// different tokens; and on that CPU this kernel is also faster than oneDNN's at 1-300 rows (the target's
// layers, 2 threads, tools/measure_kernel_vs_onednn.py: bf16 one row 6.5 against 7.2 ms, 64 rows 20.2 against
// 24.7; fp32 one row 9.9 against 10.8 ms, 64 rows 36.6 against 42.9).
//
// Layout (`pack_weight`): w [N, K] as panels of 16 output columns, k-major inside a panel, so one 64-byte
// load is the operand of one instruction for 16 columns: fp32 [N/16, K, 16] (one k: VFMADD231PS with x[m, k]
// broadcast), bf16 [N/16, K/2, 16, 2] (one k pair: VDPBF16PS with the pair x[m, 2k..2k+1] broadcast). Each
// output element is one fp32 lane that adds its products in increasing k, then + bias, + residual, then (bf16)
// one rounding to nearest even: the same sequence whatever the number of rows, the tile (4 or 1 panels × up to
// MB rows) or the thread that computes it. No horizontal sums.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>

#include "cosine_kernels.h"

namespace {

bool supported(at::ScalarType dtype) {
  if (dtype == at::kFloat) return __builtin_cpu_supports("avx512f");
  if (dtype == at::kBFloat16) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  return false;
}

template <typename T>
struct Call {
  const T* x;  // [M, K]
  const T* w;  // packed panels
  const T* bias;
  const T* residual;
  T* out;
  int64_t M, K, N;
};

using cosine::load16;  // bf16 -> fp32, 16 lanes

// fp32: panels [N/16, K, 16]; a tile is NV panels × up to MB rows.
template <int NV, int MB>
__attribute__((target("avx512f"))) void tile_f32(const Call<float>& c, int64_t m0, int64_t mb, int64_t v) {
  __m512 acc[MB][NV];
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < NV; j++) acc[i][j] = _mm512_setzero_ps();
  const float* w = c.w + v * c.K * 16;
  const float* x = c.x + m0 * c.K;
  for (int64_t k = 0; k < c.K; k++) {
    __m512 wv[NV];
    for (int j = 0; j < NV; j++) wv[j] = _mm512_loadu_ps(w + (j * c.K + k) * 16);
    for (int i = 0; i < MB; i++) {
      if (i >= mb) break;
      const __m512 xb = _mm512_set1_ps(x[i * c.K + k]);
      for (int j = 0; j < NV; j++) acc[i][j] = _mm512_fmadd_ps(xb, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < mb; i++)
    for (int j = 0; j < NV; j++) {
      const int64_t col = (v + j) * 16, o = (m0 + i) * c.N + col;
      __m512 y = acc[i][j];
      if (c.bias) y = _mm512_add_ps(y, _mm512_loadu_ps(c.bias + col));
      if (c.residual) y = _mm512_add_ps(_mm512_loadu_ps(c.residual + o), y);
      _mm512_storeu_ps(c.out + o, y);
    }
}

// bf16: panels [N/16, K/2, 16, 2] (k pairs); K counts bf16 elements.
template <int NV, int MB>
__attribute__((target("avx512f,avx512bf16"))) void tile_bf16(const Call<c10::BFloat16>& c, int64_t m0, int64_t mb,
                                                             int64_t v) {
  const int64_t K2 = c.K / 2;
  __m512 acc[MB][NV];
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < NV; j++) acc[i][j] = _mm512_setzero_ps();
  const uint32_t* w = reinterpret_cast<const uint32_t*>(c.w) + v * K2 * 16;
  const uint32_t* x = reinterpret_cast<const uint32_t*>(c.x) + m0 * K2;
  for (int64_t k = 0; k < K2; k++) {
    __m512i wv[NV];
    for (int j = 0; j < NV; j++) wv[j] = _mm512_loadu_si512(w + (j * K2 + k) * 16);
    for (int i = 0; i < MB; i++) {
      if (i >= mb) break;
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(x[i * K2 + k]));
      for (int j = 0; j < NV; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xb, (__m512bh)wv[j]);
    }
  }
  for (int i = 0; i < mb; i++)
    for (int j = 0; j < NV; j++) {
      const int64_t col = (v + j) * 16, o = (m0 + i) * c.N + col;
      __m512 y = acc[i][j];
      if (c.bias) y = _mm512_add_ps(y, load16(c.bias + col));
      if (c.residual) y = _mm512_add_ps(load16(c.residual + o), y);
      _mm256_storeu_si256((__m256i*)(c.out + o), (__m256i)_mm512_cvtneps_pbh(y));
    }
}

// Panels [v0, v1) of every row: tiles of 4 panels, then single panels; rows in groups of MB.
template <typename T, int MB, void (*Tile4)(const Call<T>&, int64_t, int64_t, int64_t),
          void (*Tile1)(const Call<T>&, int64_t, int64_t, int64_t)>
void panels(const Call<T>& c, int64_t v0, int64_t v1) {
  int64_t v = v0;
  for (; v + 4 <= v1; v += 4)
    for (int64_t m0 = 0; m0 < c.M; m0 += MB) Tile4(c, m0, std::min<int64_t>(MB, c.M - m0), v);
  for (; v < v1; v++)
    for (int64_t m0 = 0; m0 < c.M; m0 += MB) Tile1(c, m0, std::min<int64_t>(MB, c.M - m0), v);
}

// Rows per tile. fp32: 4x6 fastest at 1-300 rows. bf16: 4x6 up to BF16_WIDE_ROWS rows (a step of a few requests,
// a draft tree), 4x4 beyond. The target's 30 layers' matmuls, 2 threads, AMD EPYC: 4x6 against 4x4 at 5 / 9 / 13
// / 17 rows 7.2 / 8.8-8.9 / 10.9-11.1 / 12.6-12.9 against 8.2 / 9.8-11.2 / 11.6 / 13.8-13.9 ms (a row past a
// multiple of 4 no longer costs a whole tile), equal at 1-4 rows, within 2 % either way at 24-64, 3-4 % slower
// at 80-256 (a 6-row tile computes fewer rows per weight load than its register count suggests).
constexpr int MB_F32 = 6, MB_BF16 = 6, MB_BF16_WIDE = 4, BF16_WIDE_ROWS = 24;

at::Tensor pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "cosine::pack_weight: a weight [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0, "cosine::pack_weight: N a multiple of 16, got ", N, "x", K);
  if (w.scalar_type() == at::kFloat) return w.contiguous().view({N / 16, 16, K}).permute({0, 2, 1}).contiguous();
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "cosine::pack_weight: float32 or bfloat16");
  TORCH_CHECK(K % 2 == 0, "cosine::pack_weight: K even in bf16, got ", N, "x", K);
  return w.contiguous().view({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({N / 16, K / 2, 32});
}

}  // namespace

namespace cosine {

// wp [N/16, K, 16] (fp32) or [N/16, K/2, 32] (bf16): its K is wp.size(1) * 16 / 16 or * 2.
at::Tensor packed_linear(const at::Tensor& x_, const at::Tensor& wp, const c10::optional<at::Tensor>& bias,
                         const c10::optional<at::Tensor>& residual) {
  const at::ScalarType dt = wp.scalar_type();
  TORCH_CHECK(supported(dt), "cosine::packed_linear: this CPU lacks the instructions for ", dt);
  TORCH_CHECK(wp.dim() == 3 && wp.is_contiguous() && (wp.size(2) == 16 || wp.size(2) == 32),
              "cosine::packed_linear: a weight from cosine::pack_weight");
  const int64_t K = dt == at::kFloat ? wp.size(1) : 2 * wp.size(1), N = wp.size(0) * 16;
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == dt && x_.size(1) == K, "cosine::packed_linear: x [M, ", K,
              "] in the weight's dtype");
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0);
  at::Tensor b, r;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == dt && b.numel() == N, "cosine::packed_linear: bias [N]");
  }
  if (residual.has_value()) {
    r = residual->contiguous();
    TORCH_CHECK(r.scalar_type() == dt && r.dim() == 2 && r.size(0) == M && r.size(1) == N,
                "cosine::packed_linear: residual [M, N]");
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  // threads take runs of panels (4-panel tiles where they can); 2 threads: about half the columns each
  if (dt == at::kFloat) {
    const Call<float> c{x.data_ptr<float>(), wp.data_ptr<float>(), bias.has_value() ? b.data_ptr<float>() : nullptr,
                        residual.has_value() ? r.data_ptr<float>() : nullptr, out.data_ptr<float>(), M, K, N};
    at::parallel_for(0, N / 16, 4, [&](int64_t v0, int64_t v1) {
      panels<float, MB_F32, tile_f32<4, MB_F32>, tile_f32<1, MB_F32>>(c, v0, v1);
    });
  } else {
    using B = c10::BFloat16;
    const Call<B> c{x.data_ptr<B>(), wp.data_ptr<B>(), bias.has_value() ? b.data_ptr<B>() : nullptr,
                    residual.has_value() ? r.data_ptr<B>() : nullptr, out.data_ptr<B>(), M, K, N};
    at::parallel_for(0, N / 16, 4, [&](int64_t v0, int64_t v1) {
      if (M > BF16_WIDE_ROWS)
        panels<B, MB_BF16_WIDE, tile_bf16<4, MB_BF16_WIDE>, tile_bf16<1, MB_BF16_WIDE>>(c, v0, v1);
      else
        panels<B, MB_BF16, tile_bf16<4, MB_BF16>, tile_bf16<1, MB_BF16>>(c, v0, v1);
    });
  }
  return out;
}

}  // namespace cosine

TORCH_LIBRARY_FRAGMENT(cosine, m) {
  m.def("kernel_supported(ScalarType dtype) -> bool", supported);
  m.def("pack_weight(Tensor w) -> Tensor", pack_weight);
  m.def("packed_linear(Tensor x, Tensor wp, Tensor? bias=None, Tensor? residual=None) -> Tensor",
        cosine::packed_linear);
}
