// Attention of query tokens over the window KV cache, returning partial states (o, lse), and
// the MAW (moving average of attention weights) update of HGCA Alg. 1 line 8.
//
// Rows: for kv head g the query rows are the pairs (t, h) with h in g's group, numbered
// r = t·G + (h - g·G) (G = num_q_heads / num_kv_heads). Two kernels compute them, both with f32
// accumulation and an online softmax, K/V read as f32 or bf16 and converted on load:
//   - few rows (decoding), bf16 cache, head_dim <= 128, T·G <= 16: the streaming tensor-core
//     decode kernel of window_attention_decode.cuh (16 rows per block, per-warp cp.async
//     pipelines, q and p split into bf16 hi + lo);
//   - few rows otherwise (T·G <= 8): 4 rows per block, the block's warps stream disjoint slot
//     tiles straight from global memory and merge their states at the end;
//   - more rows (prefill chunks), bf16 cache, head_dim <= 128, no MAW update: the fast
//     tensor-core kernel of window_attention_flash.cuh (128 rows per block, bf16 q and p as in
//     FlashAttention-2, ~1e-3 on o and lse; on a 9.x device of an sm_90 build with head_dim
//     128, its wgmma variant of window_attention_hopper.cuh); with a MAW update, or when the
//     plan asks for exact operands, the kernel of window_attention_mma.cuh (64 rows per block,
//     mma.sync with q and p split into bf16 hi + lo so the results stay f32-accurate);
//   - more rows otherwise (f32 caches, head_dim > 128): 16 rows per block (4 per warp), K/V slot
//     tiles of 32 slots staged in shared memory and shared by the block's warps.
// Either way the slots may be split across `splits` blocks (flash-decoding) whose partial states
// a combine kernel merges; the plan picks the split so one wave of resident blocks fills the
// GPU. With a MAW update the decode kernel also saves its scores, so the update does not read
// the K cache a second time. o and lse must not alias q (the MAW update reads q afterwards).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker::cuda_backend {

// head_dim must be a multiple of 8 and at most this (every tile row is whole 16-byte chunks).
inline constexpr int64_t kAttentionMaxHeadDim = 256;
inline constexpr int64_t kAttentionHeadDimMultiple = 8;

// Visible entries for query token t: slots s < num_slots with 0 <= slot_pos[s] <= q_pos[t].
struct WindowAttentionArgs {
  const float* q = nullptr;           // [num_tokens, num_q_heads, head_dim], rows of q_row_stride
  int64_t q_row_stride = 0;           // floats between token t and t+1
  const int32_t* q_pos = nullptr;     // [num_tokens]
  const void* k_cache = nullptr;      // [num_kv_heads, capacity, head_dim], 16-byte aligned
  const void* v_cache = nullptr;      // [num_kv_heads, capacity, head_dim], 16-byte aligned
  DType cache_dtype = DType::kF32;    // kF32 or kBF16
  const int32_t* slot_pos = nullptr;  // [capacity], -1 = empty slot
  int64_t num_slots = 0;              // >= 1 (the backend handles an empty window itself)
  int64_t capacity = 0;
  int64_t num_tokens = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  float scale = 0.0f;
  float* o = nullptr;    // [num_tokens, num_q_heads, head_dim]
  float* lse = nullptr;  // [num_tokens, num_q_heads]; -inf = no visible slot
  float* maw = nullptr;  // [num_kv_heads, capacity] (LaunchMawUpdate only)
  float alpha = 0.0f;
  // Optional [split_counter_count] counters, all 0, that the streaming decode kernel uses to
  // merge its split states without a combine launch (and leaves at 0). Null: a combine launch.
  // Launches that use the same counters must run in stream order (one stream per counter set).
  unsigned* split_counters = nullptr;
  int64_t split_counter_count = 0;
};

struct WindowAttentionPlan {
  bool decode = true;           // the decode kernel, else a tiled one
  bool mma = false;             // the tiled one on tensor cores (window_attention_mma.cuh)
  bool stream = false;          // the decode one on tensor cores (window_attention_decode.cuh)
  // Tensor-core kernel: q and p split into bf16 hi + lo (f32-accurate). Benchmarks may clear it
  // to measure bf16-rounded operands; the backend always plans it set.
  bool exact_operands = true;
  // The fast tensor-core kernel (window_attention_flash.cuh) instead of the exact one: planned
  // for tensor-core plans without a MAW update unless PlanWindowAttention's exact_prefill.
  bool flash = false;
  int flash_variant = 0;  // its warp layout (< kFlashVariants); benchmarks compare them
  int64_t row_tiles = 0;        // blocks along the rows of one kv head
  int64_t splits = 1;           // blocks along the slots
  int64_t slots_per_split = 0;  // a multiple of 32 (of 64 for the tensor-core kernel)
  // Workspace: partial states when splits > 1 ([splits, T·Hq, head_dim] o at offset 0,
  // [splits, T·Hq] lse at part_lse_offset) and, for the decode kernel with a MAW update, the
  // scores it saves for LaunchMawUpdate ([num_kv_heads, T·G, num_slots] at scores_offset).
  // The tensor-core kernel's per-tile position summary sits at tile_min_offset.
  size_t part_lse_offset = 0;
  size_t scores_offset = 0;
  size_t tile_min_offset = 0;
  bool save_scores = false;
  size_t workspace_bytes = 0;
};
// Waves of resident blocks a decode plan's slot split aims at (issue 15 item 3: the streaming
// decode kernel runs one block per multiprocessor, so at batch 1 one wave is 8 kv heads x ~16
// splits; more waves trade longer tails for shorter per-block pipelines). 1 = the plan measured
// at ~70% of the copy rate at 32K on an H100; set from tandem-kernel-bench's decode_waves rows
// (scripts/gpu_host_decode.sh).
inline constexpr int kDecodeWaves = 1;

// Picks the kernel, and the slot split that fills `num_sms` multiprocessors with one wave of
// resident blocks (the kernels' occupancy is queried once per process and kernel); decode plans
// aim at decode_waves waves (0: kDecodeWaves; benchmarks sweep it).
// allow_tensor_cores = false keeps every plan on the f32 kernels (benchmark baseline);
// exact_prefill = true keeps prefill plans on the exact (hi + lo split) tensor-core kernel (the
// cuda backend passes BackendOptions::prefill_attention == kExact).
cudaError_t PlanWindowAttention(const WindowAttentionArgs& args, int num_sms,
                                WindowAttentionPlan* plan, bool allow_tensor_cores = true,
                                bool exact_prefill = false, int decode_waves = 0);

// Computes o and lse. `workspace` holds plan.workspace_bytes (unused when splits == 1).
cudaError_t LaunchWindowAttention(const WindowAttentionArgs& args, const WindowAttentionPlan& plan,
                                  void* workspace, cudaStream_t stream);

// After LaunchWindowAttention with the same plan and workspace: with w[t, h, s] =
// exp(score - lse[t, h]) (0 when s is not visible to t), a[g, s] = mean over the T·G rows of
// group g, and for every slot s < num_slots with slot_pos[s] >= 0:
//   maw[g, s] = maw[g, s] < 0 ? a : (1 - alpha)·maw[g, s] + alpha·a.
// Decode plans read the scores the attention kernel saved (a few MB instead of the K cache);
// tiled plans recompute them with the f32 kernels' arithmetic (grid over slot tiles), which the
// tensor-core kernel's split-bf16 scores match to ~1e-6 relative.
cudaError_t LaunchMawUpdate(const WindowAttentionArgs& args, const WindowAttentionPlan& plan,
                            const void* workspace, cudaStream_t stream);

// ---- Batched decode: one launch for many sequences' decode steps (continuous batching).
//
// One entry of a batched launch; the table of entries lives in device memory (the workspace).
struct DecodeBatchSegment {
  // The streaming decode kernel's shapes with one row tile (WindowAttentionBatchable); unlike
  // the single launch, num_slots may be 0 (every row gets o = 0, lse = -inf).
  WindowAttentionArgs args;
  int64_t splits = 1;             // blocks along the slots
  int64_t slots_per_split = 0;    // a positive multiple of 32
  // Workspace byte offsets of the partial states when splits > 1: o [splits, T·Hq, head_dim]
  // and lse [splits, T·Hq] (f32).
  int64_t part_o_offset = 0;
  int64_t part_lse_offset = 0;
};

// True when `a` can join a batched launch: bf16 cache, head_dim <= 128, T·G <= 16 rows (one
// row tile of the streaming decode kernel) and no MAW update.
bool WindowAttentionBatchable(const WindowAttentionArgs& a);

struct WindowAttentionBatchPlan {
  int64_t count = 0;
  int64_t num_kv_heads = 0;       // shared by every segment (the grid's y)
  int64_t head_dim = 0;           // the largest; every segment is in its kernel bucket
  int64_t max_splits = 1;
  int64_t max_out_rows = 0;       // largest T·Hq of a segment with splits > 1 (0: no combine)
  bool fused_merge = false;       // the attention kernel merges the splits (no combine launch)
  size_t table_bytes = 0;         // the segment table sits at workspace offset 0
  size_t workspace_bytes = 0;
};

// Chooses every segment's split (splits, slots_per_split, partial-state offsets) so that the
// blocks of all segments together (segments × kv heads × splits) fill a few waves of resident
// blocks of equal size, not one wave per segment. cudaErrorInvalidValue when a segment is not
// batchable or the segments differ in num_kv_heads or head-dim bucket.
cudaError_t PlanWindowAttentionBatch(DecodeBatchSegment* segments, int64_t count, int num_sms,
                                     WindowAttentionBatchPlan* plan);

// Computes o and lse of every segment: one attention launch over all of them and, when some
// segment splits, one combine launch over all split rows. `workspace` holds
// plan.workspace_bytes and starts with the device copy of the planned segment table
// (plan.table_bytes), which the caller uploads before this on `stream`.
cudaError_t LaunchWindowAttentionBatch(const WindowAttentionBatchPlan& plan, void* workspace,
                                       cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
