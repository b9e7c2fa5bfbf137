// Builders shared by the service tests: random KV with MAW for one layer, the proto requests
// that carry it, and the reference result over a chosen subset of entries.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tandem/common/bf16.h"
#include "tandem/cpu_attention/reference_attention.h"
#include "tandem/cpu_attention/tensor_codec.h"
#include "tandem/v1/cpu_attention.pb.h"

namespace tandem::cpu_attention::testing {

struct Geometry {
  uint32_t layers = 2, q_heads = 8, kv_heads = 2, head_dim = 64;
  uint32_t group() const { return q_heads / kv_heads; }
};

inline v1::OpenSessionRequest OpenRequest(const std::string& id, const Geometry& g,
                                          uint32_t block_size, bool bf16, float beta) {
  v1::OpenSessionRequest r;
  r.set_session_id(id);
  r.mutable_geometry()->set_num_layers(g.layers);
  r.mutable_geometry()->set_num_q_heads(g.q_heads);
  r.mutable_geometry()->set_num_kv_heads(g.kv_heads);
  r.mutable_geometry()->set_head_dim(g.head_dim);
  r.set_block_size(block_size);
  r.set_kv_dtype(bf16 ? v1::DTYPE_BF16 : v1::DTYPE_F32);
  r.set_beta(beta);
  return r;
}

// Entries of one layer held on the test side, per kv head: k, v [n, D] (values exactly
// representable in the KV dtype) and maw [n].
struct HeadEntries {
  std::vector<float> k, v, maw;
  size_t n() const { return maw.size(); }
};

// Appends `n` random entries to every head in `heads`, rounded to bf16 when asked.
inline void AddRandomEntries(std::vector<HeadEntries>& heads, size_t n, uint32_t dim, bool bf16,
                             float mean_maw, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::exponential_distribution<float> expo(1.0f);
  auto round = [bf16](float x) { return bf16 ? Bf16ToFloat(FloatToBf16(x)) : x; };
  for (HeadEntries& h : heads) {
    for (size_t i = 0; i < n * dim; ++i) h.k.push_back(round(normal(rng)));
    for (size_t i = 0; i < n * dim; ++i) h.v.push_back(round(normal(rng)));
    for (size_t i = 0; i < n; ++i) h.maw.push_back(mean_maw * expo(rng) * expo(rng));
  }
}

// AppendKv message carrying entries [first, first + count) of every head in `heads`, in order.
inline v1::AppendKvRequest AppendRequest(const std::string& session, uint32_t layer,
                                         const std::vector<HeadEntries>& heads, size_t first,
                                         size_t count, uint32_t dim, bool bf16,
                                         uint32_t window_entries) {
  v1::AppendKvRequest r;
  r.set_session_id(session);
  r.set_layer(layer);
  r.set_window_entries(window_entries);
  std::vector<float> k, v, maw;
  for (const HeadEntries& h : heads) {
    k.insert(k.end(), h.k.begin() + first * dim, h.k.begin() + (first + count) * dim);
    v.insert(v.end(), h.v.begin() + first * dim, h.v.begin() + (first + count) * dim);
    maw.insert(maw.end(), h.maw.begin() + first, h.maw.begin() + first + count);
  }
  const int64_t kv_shape[] = {static_cast<int64_t>(heads.size()), static_cast<int64_t>(count),
                              dim};
  const int64_t maw_shape[] = {static_cast<int64_t>(heads.size()), static_cast<int64_t>(count)};
  if (bf16) {
    EncodeBf16(k, kv_shape, r.mutable_k());
    EncodeBf16(v, kv_shape, r.mutable_v());
  } else {
    EncodeF32(k, kv_shape, r.mutable_k());
    EncodeF32(v, kv_shape, r.mutable_v());
  }
  EncodeF32(maw, maw_shape, r.mutable_maw());
  return r;
}

inline std::vector<float> RandomQueries(size_t tokens, const Geometry& g, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(tokens * g.q_heads * g.head_dim);
  for (float& x : q) x = normal(rng);
  return q;
}

// Reference (O, LSE) for kv head `h` over the entries where keep[i] != 0 (all if keep empty).
// q: [T, H_q, D]. Returns o [T*G, D] and lse [T*G] in (t, j) row order.
inline void ReferenceForHead(const std::vector<float>& q, size_t tokens, const Geometry& g,
                             uint32_t h, const HeadEntries& e, const std::vector<uint8_t>& keep,
                             std::vector<double>* o, std::vector<double>* lse) {
  const uint32_t D = g.head_dim, G = g.group();
  std::vector<float> k, v;
  for (size_t i = 0; i < e.n(); ++i) {
    if (!keep.empty() && !keep[i]) continue;
    k.insert(k.end(), e.k.begin() + i * D, e.k.begin() + (i + 1) * D);
    v.insert(v.end(), e.v.begin() + i * D, e.v.begin() + (i + 1) * D);
  }
  // Gather this head's group rows into [T, G, D].
  std::vector<float> qh(tokens * G * D);
  for (size_t t = 0; t < tokens; ++t) {
    for (uint32_t j = 0; j < G; ++j) {
      std::copy_n(q.begin() + (t * g.q_heads + h * G + j) * D, D,
                  qh.begin() + (t * G + j) * D);
    }
  }
  ReferenceAttention(qh.data(), k.data(), v.data(), k.size() / D, tokens, G, D,
                     1.0 / std::sqrt(static_cast<double>(D)), o, lse);
}

constexpr double kLseTolerance = 1e-4;  // absolute, natural log

// Checks an AttendResult's head `hi` (owned index) against the reference over `keep`.
inline void ExpectHeadMatches(const v1::AttendResult& r, size_t hi, size_t num_owned, uint32_t h,
                       const std::vector<float>& q, size_t tokens, const Geometry& g,
                       const HeadEntries& e, const std::vector<uint8_t>& keep, double tol) {
  std::vector<double> ref_o, ref_lse;
  ReferenceForHead(q, tokens, g, h, e, keep, &ref_o, &ref_lse);
  const float* o = reinterpret_cast<const float*>(r.o().data().data());
  const float* lse = reinterpret_cast<const float*>(r.lse().data().data());
  const uint32_t G = g.group(), D = g.head_dim;
  double max_ref = 1e-30, max_err = 0;
  for (size_t t = 0; t < tokens; ++t) {
    for (uint32_t j = 0; j < G; ++j) {
      const size_t row = t * num_owned * G + hi * G + j;
      const size_t ref_row = t * G + j;
      for (uint32_t d = 0; d < D; ++d) {
        max_ref = std::max(max_ref, std::abs(ref_o[ref_row * D + d]));
        max_err = std::max(max_err, std::abs(o[row * D + d] - ref_o[ref_row * D + d]));
      }
      if (std::isinf(ref_lse[ref_row])) {
        EXPECT_TRUE(std::isinf(lse[row]) && lse[row] < 0) << "row " << row << ": " << lse[row];
      } else {
        EXPECT_NEAR(lse[row], ref_lse[ref_row], kLseTolerance) << "head " << h << " row " << row;
      }
    }
  }
  bool empty = true;
  for (size_t i = 0; i < e.n(); ++i) empty &= !(keep.empty() || keep[i]);
  if (empty) {
    EXPECT_EQ(max_err, 0.0) << "empty selection must give O = 0";
  } else {
    EXPECT_LE(max_err / max_ref, tol) << "head " << h;
  }
}

}  // namespace tandem::cpu_attention::testing
