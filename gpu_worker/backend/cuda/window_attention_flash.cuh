// Fast tensor-core window attention for prefill plans (many query rows) over bf16 caches with
// head_dim <= 128, without a MAW update: FlashAttention-2's numerics and tiling on mma.sync
// m16n8k16. q is rounded to bf16 once (pre-multiplied by scale·log2(e)) and the softmax weights
// p to bf16 before P·V, so each product is one mma (the exact kernel of window_attention_mma.cuh
// splits both into hi + lo and pays two); accumulation stays f32.
//
// Numerics (H100; PrefillFlash in tests/gpu_worker/backend_cuda/cuda_attention_test.cc and
// tandem-kernel-bench): o and lse carry bf16's rounding of q and p (2^-9 relative per operand):
// against f64, o max abs 1.5e-3 and lse 1.7e-3 for q in [-2, 2], k and v in [-1, 1]; o relative
// L2 error 1.4-1.7e-3 at the Llama-3-8B geometry (the exact kernel: ~1e-6). At the model output
// (gutenberg-14m, cuda_prefill_logits_test.cc) log-probabilities move by up to 1.8e-2 against
// the exact kernel, less than the cuda and cpu backends already differ there (4.6e-2);
// perplexity at 8192 tokens 22.2492 (earlier runs on the exact kernel 22.2489 and 22.2495,
// golden 22.2478). l sums the bf16-rounded weights, so o = Σ p̃·v / Σ p̃ is an exact convex
// combination and lse = log Σ p̃ stays consistent with o when partial states are merged.
// TANDEM_EXACT_ATTENTION=1 keeps the backend on the exact kernel (window_attention.cuh).
//
// Speed (H100 SXM, Hq 32 / Hkv 8 x 128, causal, bench/run_kernel_bench.sh): 152-297 TFLOPS for
// 2K-16K chunks over prefixes of 0-32K, 0.73-0.86x torch SDPA's default (FlashAttention-2) and
// 2.3-2.4x the exact kernel; on Hopper the wgmma variant (window_attention_hopper.cuh) runs
// 1.7-2.0x faster.
//
// Tiles: 128 query rows per block (rows r = t·G + j of one kv head, so a K/V tile serves the
// whole GQA group; a variant picks 8 warps x 16 rows or 4 warps x 32 rows), q in shared memory as
// bf16, 64-slot K/V tiles double-buffered by cp.async, two blocks per multiprocessor. Visibility by
// slot_pos exactly as the exact kernel (the per-tile position summary of LaunchMmaTileBounds:
// a block loops over the tiles some row of it can see, masking by position except in tiles every
// row sees whole). Empty rows: o = 0, lse = -inf.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "window_attention.cuh"

namespace tandem::gpu_worker::cuda_backend {

inline constexpr int64_t kFlashRowsPerBlock = 128;
inline constexpr int64_t kFlashSlotTile = 64;  // = kMmaSlotTile: the same position summary

// Variants of the kernel (all 128 rows per block, the same numerics): 0 = 8 warps x 16 rows (one
// m16 tile per warp), 1 = 4 warps x 32 rows (two m16 tiles per warp share every K/V fragment),
// 2 = the Hopper kernel (window_attention_hopper.cuh: wgmma, head_dim 128, 9.x devices of an
// sm_90 build). Plans take the Hopper one where it is available, else kFlashDefaultVariant.
inline constexpr int kFlashVariants = 3;
inline constexpr int kFlashDefaultVariant = 1;  // 2-3% faster than 0 from 2K x 8K up (H100)
inline constexpr int kFlashHopperVariant = 2;

// True when the fast kernel handles these arguments (bf16 cache, head_dim <= 128, no MAW).
bool FlashAttentionSupports(const WindowAttentionArgs& a);

// True when `variant` runs these arguments on this device and build (variants 0 and 1 wherever
// FlashAttentionSupports; the Hopper one as window_attention_hopper.cuh says).
bool FlashVariantAvailable(const WindowAttentionArgs& a, int variant);

// The variant plans use: the Hopper kernel where available, else kFlashDefaultVariant.
int PreferredFlashVariant(const WindowAttentionArgs& a);

// Resident blocks per multiprocessor for a.head_dim's bucket and the variant.
cudaError_t FlashAttentionBlocksPerSm(const WindowAttentionArgs& a, int variant, int* blocks);

// grid [row_tiles, num_kv_heads, splits] with row_tiles = ceil(T·G / kFlashRowsPerBlock);
// slots_per_split a multiple of kFlashSlotTile. cudaErrorNotSupported for a variant not
// available here (FlashVariantAvailable). Writes o/lse when part_o is null (one split),
// else the split's partial states ([splits, T·Hq, head_dim] and [splits, T·Hq]). tile_min:
// workspace of MmaTileSummaryBytes(num_slots), filled here. cudaErrorInvalidValue for
// unsupported arguments or a bad variant.
cudaError_t LaunchFlashAttention(const WindowAttentionArgs& a, int variant, int64_t row_tiles,
                                 int64_t splits, int64_t slots_per_split, int32_t* tile_min,
                                 float* part_o, float* part_lse, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
