// The byte layout of one KV block: `block_tokens` consecutive entries of one
// (session, layer, kv-head) shard, head-contiguous as in HeadInfer.
//
//   [ K: block_tokens x head_dim elements of dtype ]   keys after RoPE
//   [ V: block_tokens x head_dim elements of dtype ]
//   [ MAW: block_tokens floats ]                         moving-average attention weight
//
// Entry t of the block has its key at K + t * row_bytes(). Entries past the shard's held count
// in its last block are unused (not zeroed).
//
// kInt8 rows (8-bit node KV, int8_rows.h) are head_dim int8 values followed by their f32
// scale: [ q: head_dim x int8 ][ scale: f32 ], value x = q * scale, symmetric per row (per
// token and kv head, for K and V alike). A row is self-contained, so appends into partial
// blocks, the selected copy, copy-on-write and migration move rows as bytes, as for bf16.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace tandem::kv_store {

enum class KvDType : uint8_t { kF32, kBf16, kInt8 };

// Bytes of one element (the int8 row's scale is counted by BlockFormat::row_bytes).
inline size_t DTypeBytes(KvDType t) {
  return t == KvDType::kF32 ? 4 : t == KvDType::kBf16 ? 2 : 1;
}
// The f32 scale that ends every kInt8 row.
inline constexpr size_t kInt8ScaleBytes = sizeof(float);
// The alignment of a shard's selected-copy buffers (shard.cc's cache-line alignment).
inline constexpr size_t kSelectedAlignment = 64;
// "f32", "bf16", "int8" (for messages and flags).
const char* KvDTypeName(KvDType t);

struct BlockFormat {
  uint32_t block_tokens = 64;  // 16..256
  uint32_t head_dim = 128;     // 8..256, multiple of 8
  KvDType dtype = KvDType::kBf16;

  // One K or V row: head_dim elements (+ the f32 scale for kInt8: head_dim 128 stores 132
  // bytes, 51.6% of bf16).
  size_t row_bytes() const {
    return size_t{head_dim} * DTypeBytes(dtype) + (dtype == KvDType::kInt8 ? kInt8ScaleBytes : 0);
  }
  size_t k_bytes() const { return size_t{block_tokens} * row_bytes(); }
  size_t k_offset() const { return 0; }
  size_t v_offset() const { return k_bytes(); }
  size_t maw_offset() const { return 2 * k_bytes(); }
  // Bytes of one entry: its K row, V row and MAW.
  size_t entry_bytes() const { return 2 * row_bytes() + sizeof(float); }
  // Bytes of one block, rounded up to 64 so every block starts cache-line aligned.
  size_t block_bytes() const { return (block_tokens * entry_bytes() + 63) / 64 * 64; }

  // Budget bytes of a shard (shard.h) holding `entries` entries, `selected` of them in its
  // selected copy (MAW selection; 0 for pages): whole blocks of block_bytes(), plus the K and V
  // selected buffers of `selected` rows each, 64-byte aligned (kSelectedAlignment). Those
  // buffers grow geometrically (BudgetedBuffer doubles), so their capacity ends between 1x and
  // 2x the aligned rows: `selected_growth` = 1 gives the least charge (one reservation of all
  // rows), 2 the most (what a plan must fit). The one formula of a shard's memory that the
  // worker's placement (RemoteKv) and memory plan use.
  uint64_t ShardBytes(uint64_t entries, uint64_t selected, uint64_t selected_growth = 1) const;

  bool operator==(const BlockFormat&) const = default;

  // INVALID_ARGUMENT naming the field when a value is outside the ranges above.
  absl::Status Validate() const;
};

}  // namespace tandem::kv_store
