// Tensor-core window attention for prefill plans (many query rows) over bf16 caches with
// head_dim <= 128: FlashAttention-2-style tiles on mma.sync m16n8k16 (bf16 operands, f32
// accumulators). 64 query rows per block (16 per warp, the rows r = t·G + j of one kv head, so a
// K/V tile serves the whole GQA group), 64-slot K/V tiles double-buffered in shared memory by
// cp.async, the online softmax in registers.
//
// Numerics: the f32 operands (q, and the probabilities p) are split into bf16 hi + lo parts and
// both are multiplied (x·k = hi·k + lo·k with exact products and f32 sums), so the scores and
// o match the f32 kernels to ~1e-6 relative instead of bf16's 4e-3; that costs two mma per
// product. LSE in natural log, empty rows o = 0 and lse = -inf, like the other kernels.
//
// Visibility by slot_pos, as for every window kernel: a small first kernel writes, per 64-slot
// tile, the smallest and largest position held in it; a block scans those for the first and
// last tile any of its rows can see and loops over that range only (causal prefill skips
// everything past its diagonal), masking scores by position except in tiles every row of the
// block sees whole.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "window_attention.cuh"

namespace tandem::gpu_worker::cuda_backend {

inline constexpr int64_t kMmaRowsPerBlock = 64;
inline constexpr int64_t kMmaSlotTile = 64;

// True when the tensor-core kernel handles these arguments (bf16 cache, head_dim <= 128).
bool MmaAttentionSupports(const WindowAttentionArgs& a);

// Resident blocks per multiprocessor of the tensor-core kernel for a.head_dim's bucket.
cudaError_t MmaAttentionBlocksPerSm(const WindowAttentionArgs& a, bool exact, int* blocks);

// Bytes of the per-tile position summary (2 x [ceil(num_slots / 64)] int32) in the workspace.
size_t MmaTileSummaryBytes(int64_t num_slots);

// The per-tile position summary both tensor-core prefill kernels read: for 64-slot tile j,
// tile_min[j] = the smallest slot_pos >= 0 in it (INT32_MAX: none) and tile_min[tiles + j] =
// the largest (INT32_MAX when the tile has an empty slot or slots past num_slots, so that every
// score of it needs the position mask). tile_min: MmaTileSummaryBytes(num_slots).
cudaError_t LaunchMmaTileBounds(const int32_t* slot_pos, int64_t num_slots, int32_t* tile_min,
                                cudaStream_t stream);

// grid [row_tiles, num_kv_heads, splits]; slots_per_split a multiple of kMmaSlotTile. Writes
// o/lse when part_o is null (one split), else the split's partial states ([splits, T·Hq,
// head_dim] and [splits, T·Hq]). tile_min: workspace of MmaTileSummaryBytes(num_slots).
// exact = false multiplies bf16-rounded q and p (FlashAttention's numerics, ~4e-3 relative,
// half the mma work): a measurement variant the backend never selects (benchmarks only, see
// WindowAttentionPlan::exact_operands). scores: optional [num_kv_heads, T·G, num_slots] for the
// MAW update; written for the (row, slot) pairs of the tiles a block visits (the others are
// invisible to every row of the block and stay unwritten).
cudaError_t LaunchMmaAttention(const WindowAttentionArgs& a, int64_t row_tiles, int64_t splits,
                               int64_t slots_per_split, bool exact, int32_t* tile_min,
                               float* part_o, float* part_lse, float* scores,
                               cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
