// The greedy token of fp32 logits from a bf16 screen of the head: one call per step (see engine/greedy_head.py
// for why and for the bound). For each row x of [R, K] fp32:
//   A = bf16(x) @ screen.T (CoSine's bf16 matmul, [V] bf16), top = max A, B = the row's bound (below),
//   candidates = every t with A_t >= top - 2B (in double, exact), their exact logits the fp32 matmul's own lanes
//   (the panel of the packed fp32 head that holds t, summed as the kernel sums it: lane-wise fma in increasing k
//   from +0), and the token the first candidate (in vocabulary order) with the largest exact logit.
// A row with anything not finite, or more than max_candidates candidates, gets -1: the caller takes the full
// head for it. Returns (tokens int64 [R], bounds float64 [R]).
//
// B = (g |x| |w| + 2 g |xb| |wb| + |x| |d| + |e| |wb| + 2^-8 max|A|) * 1.001 + 1e-5, with xb = bf16(x),
// e = x - xb, g = K u / (1 - K u), u = 2^-24, and |w|, |wb|, |d| the head's largest row norms of the fp32 rows,
// their bf16 roundings and the differences.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cosine_kernels.h"

namespace {

// the fp32 kernel's 16 lanes of panel v for the row x: the same sequence of fused multiply-adds as its tiles
__attribute__((target("avx512f"))) void panel_lanes(const float* x, const float* panel, int64_t K, float* out) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) acc = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), _mm512_loadu_ps(panel + k * 16), acc);
  _mm512_storeu_ps(out, acc);
}

struct Head {
  const c10::BFloat16* approx;  // [R, V]
  const float* packed;          // [V/16, K, 16]
  int64_t K, V;
  double w_norm, wb_norm, d_norm, g;
  int64_t max_candidates;
};

// max and largest magnitude of a row of A (V a multiple of 16); false where any is not finite
__attribute__((target("avx512f"))) bool scan(const c10::BFloat16* a, int64_t V, float& top, float& mag) {
  __m512 mx = _mm512_set1_ps(-INFINITY), mg = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t t = 0; t < V; t += 16) {
    const __m512 v = cosine::load16(a + t);
    bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ);  // inf - inf, NaN: NaN
    mx = _mm512_max_ps(mx, v);
    mg = _mm512_max_ps(mg, _mm512_abs_ps(v));
  }
  top = _mm512_reduce_max_ps(mx), mag = _mm512_reduce_max_ps(mg);
  return bad == 0;
}

// the token of row r (-1: the caller's full head), and its bound
__attribute__((target("avx512f"))) int64_t row(const Head& h, const float* xr, const c10::BFloat16* xbr,
                                               const c10::BFloat16* ar, double& bound) {
  double nx = 0, ne = 0, nxb = 0;
  bool finite = true;
  for (int64_t k = 0; k < h.K; k++) {
    const double a = xr[k], b = static_cast<float>(xbr[k]);
    finite = finite && std::isfinite(a);
    nx += a * a, nxb += b * b, ne += (a - b) * (a - b);
  }
  float top, mag;
  finite = scan(ar, h.V, top, mag) && finite;
  nx = std::sqrt(nx), ne = std::sqrt(ne), nxb = std::sqrt(nxb);
  bound = (h.g * nx * h.w_norm + 2 * h.g * nxb * h.wb_norm + nx * h.d_norm + ne * h.wb_norm +
           std::ldexp((double)mag, -8)) * 1.001 + 1e-5;
  if (!finite || !std::isfinite(bound)) return -1;
  const double cut = (double)top - 2 * bound;
  float cutf = (float)cut;  // at or below the cut: a few more candidates at most, never fewer
  if ((double)cutf > cut) cutf = std::nextafter(cutf, -INFINITY);
  const __m512 cv = _mm512_set1_ps(cutf);
  std::vector<int64_t> cand;
  for (int64_t t = 0; t < h.V; t += 16) {
    __mmask16 m = _mm512_cmp_ps_mask(cosine::load16(ar + t), cv, _CMP_GE_OQ);
    while (m) {
      cand.push_back(t + __builtin_ctz(m));
      m &= m - 1;
    }
    if ((int64_t)cand.size() > h.max_candidates) return -1;
  }
  float best = -INFINITY, lanes[16];
  int64_t best_t = -1, panel = -1;
  for (const int64_t t : cand) {  // in vocabulary order: the first of equal maxima wins, as torch.argmax
    if (t / 16 != panel) panel = t / 16, panel_lanes(xr, h.packed + panel * h.K * 16, h.K, lanes);
    const float e = lanes[t % 16];
    if (!std::isfinite(e)) return -1;
    if (best_t < 0 || e > best) best = e, best_t = t;
  }
  return best_t;
}

std::tuple<at::Tensor, at::Tensor> greedy_tokens(const at::Tensor& x_, const at::Tensor& screen,
                                                 const at::Tensor& packed, double w_norm, double wb_norm,
                                                 double d_norm, int64_t max_candidates) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16"),
              "cosine::greedy_tokens: AVX-512 with AVX512-BF16");
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat, "cosine::greedy_tokens: x [R, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous() && packed.size(1) == x_.size(1),
              "cosine::greedy_tokens: the fp32 head as cosine::pack_weight packs it, K columns");
  const at::Tensor x = x_.contiguous();
  const int64_t R = x.size(0), K = x.size(1), V = packed.size(0) * 16;
  const at::Tensor xb = x.to(at::kBFloat16);
  const at::Tensor approx = cosine::packed_linear(xb, screen, c10::nullopt, c10::nullopt);
  TORCH_CHECK(approx.size(1) == V, "cosine::greedy_tokens: the screen and the head have other vocabularies");
  at::Tensor tokens = at::empty({R}, x.options().dtype(at::kLong));
  at::Tensor bounds = at::empty({R}, x.options().dtype(at::kDouble));
  const double u = std::ldexp(1.0, -24);
  const Head h{approx.data_ptr<c10::BFloat16>(), packed.data_ptr<float>(), K, V, w_norm, wb_norm, d_norm,
               K * u / (1 - K * u), max_candidates};
  const float* xp = x.data_ptr<float>();
  const c10::BFloat16* xbp = xb.data_ptr<c10::BFloat16>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  double* bp = bounds.data_ptr<double>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) tp[r] = row(h, xp + r * K, xbp + r * K, h.approx + r * V, bp[r]);
  });
  return {tokens, bounds};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cosine, m) {
  m.def("greedy_tokens(Tensor x, Tensor screen, Tensor packed, float w_norm, float wb_norm, float d_norm, "
        "int max_candidates) -> (Tensor, Tensor)",
        greedy_tokens);
}
