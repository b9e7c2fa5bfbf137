// Hopper window attention for prefill plans: the fast kernel's numerics
// (window_attention_flash.cuh: q and p rounded to bf16, f32 accumulation, the same position masks,
// split states and empty rows; only the softmax's row sum adds the f32 weights, not their roundings) on sm_90a's warpgroup MMA (wgmma.mma_async), which issues a 64 x 128
// x 16 product per instruction from shared memory and keeps the tensor cores busier than mma.sync
// can. Compiled only when the build targets sm_90 (tandem_backend_cuda_hopper, as sm_90a code),
// launched only on a device of compute capability 9.x; bf16 caches (16-byte aligned, as TMA
// needs) with head_dim 128 and no MAW update.
//
// Tiles: 128 query rows per block (rows r = t·G + j of one kv head), q in shared memory as bf16,
// 128-slot K/V tiles in 3 stages, all in the 128-byte swizzled layout wgmma reads
// (hopper_device.cuh); one block of three warpgroups per multiprocessor (227 KiB of shared
// memory). Warpgroup 2 loads: the tensor memory accelerator copies K and V of tiles whose 128
// slots all hold a position (two 64-column boxes each, of a tensor map per cache built at
// launch); cp.async the slot positions, and K and V of the other tiles (empty slots, whose V rows
// the loaders zero; slots past the split or the window, as zeros); a stage is full on an mbarrier
// when they have landed; the loaders' registers go to the others (setmaxnreg). Warpgroups 0 and
// 1 (64 rows each) take ping-pong turns issuing, per tile, S = Q·Kᵀ (8 wgmma from shared memory)
// with the previous tile's O += P·V (8 wgmma, P from registers, V MN-major from shared memory),
// then the position mask and online softmax on S's registers while the other's products run.
// Speed (H200s, bench/run_kernel_bench.sh shapes, df46413): 368-661 TFLOP/s, 0.85-1.09x cuDNN's
// SDPA without a prefix and 1.9-2.8x with one; BENCHMARKS "A Hopper prefill attention kernel" and
// "The Hopper prefill kernel's fixed costs and row sum".
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "window_attention.cuh"

namespace tandem::gpu_worker::cuda_backend {

// True when this build holds the kernel (it targets sm_90) and the current device is 9.x.
bool HopperAttentionAvailable();

// True for the shapes the kernel handles: bf16 cache, head_dim 128, no MAW update.
bool HopperAttentionSupports(const WindowAttentionArgs& a);

// grid [row_tiles, num_kv_heads, splits], row_tiles = ceil(T·G / 128); slots_per_split a
// multiple of 64. tile_min / tile_max: the 64-slot position summary of LaunchMmaTileBounds
// (already filled). Writes o/lse when part_o is null, else the split's partial states
// ([splits, T·Hq, head_dim] and [splits, T·Hq]). cudaErrorInvalidValue for unsupported
// arguments, cudaErrorNotSupported when !HopperAttentionAvailable().
cudaError_t LaunchHopperAttention(const WindowAttentionArgs& a, int64_t row_tiles, int64_t splits,
                                  int64_t slots_per_split, const int32_t* tile_min,
                                  const int32_t* tile_max, float* part_o, float* part_lse,
                                  cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
