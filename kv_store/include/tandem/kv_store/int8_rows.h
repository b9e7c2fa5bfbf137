// 8-bit KV rows (--node_kv_dtype=int8): symmetric quantisation with one f32 scale per row, i.e.
// per (token, kv head) for K and for V (the row layout is in block_format.h).
//
// Why per row and not KIVI's per-channel K: a row is self-contained, so a block filled by many
// small appends, the contiguous selected copy (MAW), copy-on-write and shard migration move
// int8 rows exactly as bf16 rows; per-channel scales over a block would have to be fixed when
// the block's first row arrives or requantise the block on every append. At 8 bits the per-row
// step (max|x| / 127, <= 0.4% of the row's largest element) is far below what KIVI's per-channel
// K grouping is for (2 bits); the measured cost is in the report of issue 15 item 4.
//
// Error bound: |x - q * scale| <= scale / 2 for every element, scale = max|row| / 127; a zero
// row has scale 0 and dequantises to zeros. Non-finite inputs quantise to 0 with the row's
// finite maximum as scale (the KV of a healthy model is finite; this only keeps the node's
// arithmetic defined).
//
// Thread-safe (pure functions). The loops are compiled for AVX-512, AVX2 and baseline x86-64.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "tandem/kv_store/block_format.h"

namespace tandem::kv_store {

// The scale of one kInt8 row of `head_dim` values.
inline float Int8RowScale(const std::byte* row, uint32_t head_dim) {
  float s;
  std::memcpy(&s, row + head_dim, sizeof(s));
  return s;
}

// src: [rows, head_dim] of src_dtype (kF32 or kBf16), dst: [rows] kInt8 rows of
// head_dim + kInt8ScaleBytes bytes. src and dst must not overlap.
void QuantizeRowsInt8(const std::byte* src, KvDType src_dtype, size_t rows, uint32_t head_dim,
                      std::byte* dst);

// src: [rows] kInt8 rows; dst: [rows, head_dim] of dst_dtype (kF32: q * scale exactly as f32;
// kBf16: q * scale rounded to nearest-even bf16).
void DequantizeRowsInt8(const std::byte* src, size_t rows, uint32_t head_dim, KvDType dst_dtype,
                        std::byte* dst);

// Rows of src_dtype into rows of dst_dtype (the node stores `dst_dtype`, the wire carries
// `src_dtype`, or the reverse): a copy when they are equal, else quantise or dequantise; f32 <->
// bf16 converts (bf16 rounds to nearest-even). Sizes from BlockFormat{.., head_dim, dtype}.
void ConvertRows(const std::byte* src, KvDType src_dtype, size_t rows, uint32_t head_dim,
                 std::byte* dst, KvDType dst_dtype);

}  // namespace tandem::kv_store
