// CoSine's attention for decode and verify steps on AVX-512 CPUs: every new row is its own attention problem
// over the keys it sees, listed in the order plain decoding would have them, and its bits depend on that list
// alone.
//
// Why: a draft tree stores its nodes one after another in the cache, so a node off the tree's main chain sees
// its ancestors at other places than plain decoding would put them (siblings in between). SDPA over a masked
// block sums the same terms in another grouping, and in bf16 that changed tokens: trees were verified along
// their main chain only. Here a row names its keys as a logical sequence: the first `prefix` entries of its
// slot's cache (the tokens committed before the step), then `extra` storage indices (its ancestors in the
// tree, root first, then itself). A node then computes what plain decoding computes for the same tokens, bit
// for bit, and so does a row of a chain, of a batch of any size, of any thread. It is also cheaper than SDPA
// at these shapes (one to a few dozen rows: SDPA's per-call overhead was ~10% of a bf16 decode step).
//
// Arithmetic, all in fp32 and in logical key order j: s_j = (q . k_j) * scale, the dot product as 16-lane FMAs
// over the head dimension then one fixed horizontal sum; m = max_j s_j; p_j = exp(s_j - m) (a polynomial
// exp, ~1 ulp); l = sum of p_j in 16 lanes (lane = j mod 16) then one fixed horizontal sum; o = sum_j p_j v_j
// in increasing j; out = o / l, rounded once to the cache's dtype.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "cosine_kernels.h"

namespace {

constexpr int kMaxRep = 16;  // query heads per key/value head
constexpr int kMaxDim = 256;  // head dimension

using cosine::exp16;
using cosine::load16;

template <typename T>
struct Problem {
  const T* q;  // row n, head h at q + n * q_row + h * q_head
  int64_t q_row, q_head;
  const T* k;  // [S, nkv, M, hd]
  const T* v;
  const int64_t* slots;
  const int64_t* prefix;
  const int64_t* offsets;  // [N + 1] into index
  const int64_t* index;
  T* out;  // [N, nh * hd]
  int64_t nkv, nrep, M, hd;
  float scale;
};

template <typename T>
__attribute__((target("avx512f"))) void one(const Problem<T>& p, int64_t n, int64_t g, std::vector<float>& buf) {
  const int64_t P = p.prefix[n], e0 = p.offsets[n], E = p.offsets[n + 1] - e0, L = P + E, hd = p.hd, C = hd / 16;
  const int64_t base = (p.slots[n] * p.nkv + g) * p.M;
  const int64_t Lp = (L + 15) / 16 * 16;
  buf.resize(p.nrep * Lp);
  float* s = buf.data();
  __m512 qv[kMaxRep][kMaxDim / 16];
  for (int64_t r = 0; r < p.nrep; r++)
    for (int64_t c = 0; c < C; c++) qv[r][c] = load16(p.q + n * p.q_row + (g * p.nrep + r) * p.q_head + c * 16);
  auto key = [&](int64_t j) { return base + (j < P ? j : p.index[e0 + j - P]); };
  // scores
  float m[kMaxRep];
  for (int64_t r = 0; r < p.nrep; r++) m[r] = -INFINITY;
  for (int64_t j = 0; j < L; j++) {
    const T* kp = p.k + key(j) * hd;
    __m512 kv[kMaxDim / 16];
    for (int64_t c = 0; c < C; c++) kv[c] = load16(kp + c * 16);
    for (int64_t r = 0; r < p.nrep; r++) {
      __m512 acc = _mm512_mul_ps(qv[r][0], kv[0]);
      for (int64_t c = 1; c < C; c++) acc = _mm512_fmadd_ps(qv[r][c], kv[c], acc);
      const float x = _mm512_reduce_add_ps(acc) * p.scale;
      s[r * Lp + j] = x;
      m[r] = x > m[r] ? x : m[r];
    }
  }
  // probabilities and their sums
  float inv[kMaxRep];
  for (int64_t r = 0; r < p.nrep; r++) {
    const __m512 mv = _mm512_set1_ps(m[r]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; j += 16) {
      const __mmask16 live = L - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - j)) - 1);
      __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + r * Lp + j), mv));
      e = _mm512_maskz_mov_ps(live, e);
      _mm512_mask_storeu_ps(s + r * Lp + j, live, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  // weighted values
  __m512 o[kMaxRep][kMaxDim / 16];
  for (int64_t r = 0; r < p.nrep; r++)
    for (int64_t c = 0; c < C; c++) o[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; j++) {
    const T* vp = p.v + key(j) * hd;
    for (int64_t c = 0; c < C; c++) {
      const __m512 vv = load16(vp + c * 16);
      for (int64_t r = 0; r < p.nrep; r++) o[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[r * Lp + j]), vv, o[r][c]);
    }
  }
  for (int64_t r = 0; r < p.nrep; r++) {
    T* dst = p.out + n * p.nkv * p.nrep * hd + (g * p.nrep + r) * hd;
    const __m512 iv = _mm512_set1_ps(inv[r]);
    for (int64_t c = 0; c < C; c++) {
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, _mm512_mul_ps(o[r][c], iv));
      for (int i = 0; i < 16; i++) dst[c * 16 + i] = static_cast<T>(tmp[i]);  // bf16: round to nearest even
    }
  }
}

}  // namespace

namespace cosine {

at::Tensor attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                          const at::Tensor& prefix, const at::Tensor& offsets, const at::Tensor& index, double scale) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && (dt == at::kFloat || dt == at::kBFloat16),
              "cosine::attention_rows: float32 or bfloat16 on a CPU with AVX-512");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "cosine::attention_rows: q [N, heads, head_dim], unit stride inside a head");
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() &&
                  k.scalar_type() == dt && v.scalar_type() == dt,
              "cosine::attention_rows: k and v [slots, kv_heads, max_len, head_dim], contiguous, q's dtype");
  const int64_t N = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k.size(1), M = k.size(2);
  TORCH_CHECK(k.size(3) == hd && hd % 16 == 0 && hd <= kMaxDim, "cosine::attention_rows: head_dim a multiple of 16 up to ",
              kMaxDim);
  TORCH_CHECK(nh % nkv == 0 && nh / nkv <= kMaxRep, "cosine::attention_rows: heads a multiple of kv_heads, at most ",
              kMaxRep, " per kv head");
  for (const auto* t : {&slots, &prefix, &offsets, &index})
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kLong && t->is_contiguous(),
                "cosine::attention_rows: slots, prefix, offsets and index are int64 vectors");
  TORCH_CHECK(slots.numel() == N && prefix.numel() == N && offsets.numel() == N + 1,
              "cosine::attention_rows: slots and prefix [N], offsets [N + 1]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* pr = prefix.data_ptr<int64_t>();
  const int64_t* of = offsets.data_ptr<int64_t>();
  const int64_t* ix = index.data_ptr<int64_t>();
  TORCH_CHECK(N == 0 || (of[0] == 0 && of[N] == index.numel()), "cosine::attention_rows: offsets from 0 to index's length");
  for (int64_t n = 0; n < N; n++) {
    TORCH_CHECK(sl[n] >= 0 && sl[n] < k.size(0), "cosine::attention_rows: slot out of range");
    TORCH_CHECK(pr[n] >= 0 && pr[n] <= M && of[n + 1] >= of[n] && pr[n] + of[n + 1] - of[n] >= 1,
                "cosine::attention_rows: every row sees at least one key, its prefix within the cache");
  }
  for (int64_t i = 0; i < index.numel(); i++)
    TORCH_CHECK(ix[i] >= 0 && ix[i] < M, "cosine::attention_rows: key index out of range");
  auto out = at::empty({N, nh * hd}, q.options().memory_format(c10::MemoryFormat::Contiguous));
  const int64_t items = N * nkv;
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Problem<T> p{(const T*)q.data_ptr(), q.stride(0), q.stride(1), (const T*)k.data_ptr(), (const T*)v.data_ptr(),
                 sl, pr, of, ix, (T*)out.data_ptr(), nkv, nh / nkv, M, hd, (float)scale};
    at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> buf;
      for (int64_t i = i0; i < i1; i++) one<T>(p, i / nkv, i % nkv, buf);
    });
  };
  if (dt == at::kFloat)
    run((float*)nullptr);
  else
    run((c10::BFloat16*)nullptr);
  return out;
}

}  // namespace cosine

TORCH_LIBRARY_FRAGMENT(cosine, m) {
  m.def("attention_rows(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor prefix, Tensor offsets, Tensor index, "
        "float scale) -> Tensor",
        cosine::attention_rows);
}
