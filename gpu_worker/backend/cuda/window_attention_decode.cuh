// Streaming decode kernel for window attention over bf16 caches with head_dim <= 128: the 16
// query rows of a block (one m16 fragment: T·G rows of a kv head, so the whole GQA group shares
// every K/V load) against the slots of a split, on tensor cores (mma.sync m16n8k16, q and p
// split into bf16 hi + lo as in window_attention_mma.cuh, f32 accumulation; a block of at most 8
// rows, a decode token's GQA group, carries the lo halves in the fragment's 8 padding rows, so
// each pair costs one mma instead of two). Each of the 8
// warps streams its own 16-slot K/V tiles through a 3-stage cp.async pipeline (8 KB per tile
// at head_dim 128), keeping its own online-softmax state; the warps' states are merged at the
// end. The tensor cores leave the SIMT pipes nearly idle, so the kernel runs at the speed of
// its loads; one block per multiprocessor (the pipelines fill shared memory).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "window_attention.cuh"

namespace tandem::gpu_worker::cuda_backend {

inline constexpr int64_t kDecodeStreamRows = 16;  // query rows per block
// Splits up to which the kernel merges the partial states itself (its shared memory holds the
// merge weights of 16 rows).
inline constexpr int64_t kMaxFusedSplits = 256;

// True when the streaming kernel handles these arguments (bf16 cache, head_dim <= 128).
bool DecodeStreamSupports(const WindowAttentionArgs& a);

// Resident blocks per multiprocessor of the streaming kernel for a.head_dim's bucket.
cudaError_t DecodeStreamBlocksPerSm(const WindowAttentionArgs& a, int* blocks);

// grid [row_tiles (16 rows each), num_kv_heads, splits]; slots_per_split a multiple of 16
// (the warps' tile).
// part_o / part_lse: the splits' partial states when splits > 1 (null: write o / lse);
// scores: optional [num_kv_heads, T·G, num_slots] saved scores (-inf = not visible) for the
// MAW update.
// When splits > 1 and a.split_counters has room for row_tiles·num_kv_heads counters, the
// kernel merges the splits' partial states into o / lse itself (the last block of each row tile
// and kv head to finish; no combine launch): DecodeStreamMergeCounters says whether it will
// (non-null), so the caller knows not to launch the combine.
unsigned* DecodeStreamMergeCounters(const WindowAttentionArgs& a, int64_t row_tiles,
                                    int64_t splits);
cudaError_t LaunchDecodeStream(const WindowAttentionArgs& a, int64_t row_tiles, int64_t splits,
                               int64_t slots_per_split, float* part_o, float* part_lse,
                               float* scores, cudaStream_t stream);

// The batched form (window_attention.cuh's LaunchWindowAttentionBatch): grid [max_splits,
// num_kv_heads, count]; block (x, g, i) runs split x of kv head g of segments[i] (device memory)
// when x < its splits, writing o / lse (one split) or its partial state in `workspace`.
// head_dim picks the kernel bucket shared by every segment. fused_merge: segments with splits > 1
// merge their partial states in the kernel, on the counters at their args.split_counters
// (segment i, kv head g: counter i·num_kv_heads + g); else a combine launch must follow.
cudaError_t LaunchDecodeStreamBatch(const DecodeBatchSegment* segments, int64_t count,
                                    int64_t max_splits, int64_t num_kv_heads, int64_t head_dim,
                                    void* workspace, bool fused_merge, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
