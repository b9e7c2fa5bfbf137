// Deterministic KV test data and readers shared by the kv_store tests.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "tandem/common/bf16.h"
#include "tandem/kv_store/block_format.h"
#include "tandem/kv_store/shard.h"

namespace tandem::kv_store::testing {

// [n, head_dim] rows of `dtype` whose values depend on (seed, entry, dim), so a row read back
// from the wrong place does not match. bf16 values are produced as bf16 bits, so a byte
// comparison is exact for both dtypes.
inline std::vector<std::byte> MakeRows(KvDType dtype, uint64_t n, uint32_t head_dim,
                                       uint32_t seed) {
  std::vector<std::byte> out(n * head_dim * DTypeBytes(dtype));
  for (uint64_t i = 0; i < n; ++i) {
    for (uint32_t d = 0; d < head_dim; ++d) {
      const float value = static_cast<float>(seed) * 0.25f + static_cast<float>(i) * 0.5f -
                          static_cast<float>(d) * 0.0078125f;
      const size_t index = i * head_dim + d;
      if (dtype == KvDType::kF32) {
        std::memcpy(out.data() + index * 4, &value, 4);
      } else {
        const bf16_t bits = FloatToBf16(value);
        std::memcpy(out.data() + index * 2, &bits, 2);
      }
    }
  }
  return out;
}

// MAW values cycling through [0, 4 * threshold) so a threshold rule selects about 3/4.
inline std::vector<float> MakeMaw(uint64_t n, float threshold, uint32_t seed) {
  std::vector<float> out(n);
  for (uint64_t i = 0; i < n; ++i) {
    out[i] = threshold * static_cast<float>((i * 7 + seed * 13) % 16) * 0.25f;
  }
  return out;
}

// Entry i's K row, V row and MAW read back through the shard's block table.
inline std::vector<std::byte> BlockK(const Shard& shard, uint64_t i) {
  const BlockFormat& f = shard.format();
  const std::byte* src = shard.block_k(i / f.block_tokens) + (i % f.block_tokens) * f.row_bytes();
  return std::vector<std::byte>(src, src + f.row_bytes());
}
inline std::vector<std::byte> BlockV(const Shard& shard, uint64_t i) {
  const BlockFormat& f = shard.format();
  const std::byte* src = shard.block_v(i / f.block_tokens) + (i % f.block_tokens) * f.row_bytes();
  return std::vector<std::byte>(src, src + f.row_bytes());
}
inline float BlockMaw(const Shard& shard, uint64_t i) {
  const BlockFormat& f = shard.format();
  return shard.block_maw(i / f.block_tokens)[i % f.block_tokens];
}
inline std::vector<std::byte> SelectedK(const Shard& shard, uint64_t row) {
  const size_t bytes = shard.format().row_bytes();
  return std::vector<std::byte>(shard.selected_k() + row * bytes,
                                shard.selected_k() + (row + 1) * bytes);
}
inline std::vector<std::byte> SelectedV(const Shard& shard, uint64_t row) {
  const size_t bytes = shard.format().row_bytes();
  return std::vector<std::byte>(shard.selected_v() + row * bytes,
                                shard.selected_v() + (row + 1) * bytes);
}
// Row i of a [n, head_dim] host array.
inline std::vector<std::byte> Row(const std::vector<std::byte>& rows, const BlockFormat& f,
                                  uint64_t i) {
  return std::vector<std::byte>(rows.begin() + i * f.row_bytes(),
                                rows.begin() + (i + 1) * f.row_bytes());
}

// What a shard should hold: every appended entry and its flag, in entry order.
struct ShardModel {
  explicit ShardModel(const BlockFormat& f) : format(f) {}

  void Append(const std::vector<std::byte>& k_rows, const std::vector<std::byte>& v_rows,
              const std::vector<float>& maw_rows, SelectRule rule) {
    k.insert(k.end(), k_rows.begin(), k_rows.end());
    v.insert(v.end(), v_rows.begin(), v_rows.end());
    maw.insert(maw.end(), maw_rows.begin(), maw_rows.end());
    for (float m : maw_rows) selected.push_back(rule.Selects(m) ? 1 : 0);
  }
  void Truncate(uint64_t n) {
    if (n >= held()) return;
    k.resize(n * format.row_bytes());
    v.resize(n * format.row_bytes());
    maw.resize(n);
    selected.resize(n);
  }
  uint64_t held() const { return maw.size(); }
  uint64_t selected_count() const {
    uint64_t c = 0;
    for (uint8_t f : selected) c += f;
    return c;
  }

  BlockFormat format;
  std::vector<std::byte> k, v;  // [held, head_dim] of format.dtype
  std::vector<float> maw;       // [held]
  std::vector<uint8_t> selected;
};

// Checks the block table, every entry's K/V/MAW read back through the blocks, the flags and
// the contiguous selected copy (exactly the selected entries, in entry order).
inline void ExpectShardMatches(const Shard& shard, const ShardModel& model) {
  const BlockFormat& f = model.format;
  const size_t row = f.row_bytes();
  ASSERT_EQ(shard.held(), model.held());
  ASSERT_EQ(shard.blocks().size(), (model.held() + f.block_tokens - 1) / f.block_tokens);
  for (size_t b = 0; b < shard.blocks().size(); ++b) {
    const uint64_t expected = std::min<uint64_t>(f.block_tokens, model.held() - b * f.block_tokens);
    ASSERT_EQ(shard.block_entries(b), expected) << "block " << b;
  }
  for (uint64_t i = 0; i < model.held(); ++i) {
    const std::byte* k = shard.block_k(i / f.block_tokens) + (i % f.block_tokens) * row;
    const std::byte* v = shard.block_v(i / f.block_tokens) + (i % f.block_tokens) * row;
    ASSERT_EQ(std::memcmp(k, model.k.data() + i * row, row), 0) << "K of entry " << i;
    ASSERT_EQ(std::memcmp(v, model.v.data() + i * row, row), 0) << "V of entry " << i;
    ASSERT_EQ(BlockMaw(shard, i), model.maw[i]) << "MAW of entry " << i;
  }
  ASSERT_EQ(shard.selected_flags().size(), model.held());
  for (uint64_t i = 0; i < model.held(); ++i) {
    ASSERT_EQ(shard.selected_flags()[i], model.selected[i]) << "flag of entry " << i;
  }
  ASSERT_EQ(shard.selected_count(), model.selected_count());
  uint64_t out = 0;
  for (uint64_t i = 0; i < model.held(); ++i) {
    if (!model.selected[i]) continue;
    ASSERT_EQ(std::memcmp(shard.selected_k() + out * row, model.k.data() + i * row, row), 0)
        << "selected K row " << out << " (entry " << i << ")";
    ASSERT_EQ(std::memcmp(shard.selected_v() + out * row, model.v.data() + i * row, row), 0)
        << "selected V row " << out << " (entry " << i << ")";
    ++out;
  }
  ASSERT_GE(shard.selected_capacity_bytes(), 2 * out * row);
}

}  // namespace tandem::kv_store::testing
