#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "attention_common.cuh"
#include "window_attention.cuh"
#include "window_attention_decode.cuh"
#include "window_attention_flash.cuh"
#include "window_attention_mma.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

// Query rows (T·G) up to which the decode kernel (4 rows per block) is used; the streaming
// tensor-core decode kernel takes up to kDecodeStreamRows.
constexpr int64_t kDecodeMaxRows = 8;
constexpr int kTiledRows = kAttnWarps * kRowsPerWarp;  // rows per block of the tiled kernel
constexpr int64_t kMaxSplits = 256;
constexpr size_t kWorkspaceAlign = 256;

size_t AlignUp(size_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// Writes element d of query row `row` of kv head g: to o/lse when part_o is null (one split),
// else to split `split`'s partial state ([splits, T·Hq, head_dim] and [splits, T·Hq]).
__device__ __forceinline__ void StoreOutput(const WindowAttentionArgs& a, float* part_o,
                                            float* part_lse, int64_t split, int64_t g, int64_t row,
                                            int d, float value, float lse) {
  const int64_t group = a.num_q_heads / a.num_kv_heads;
  const int64_t out_row = (row / group) * a.num_q_heads + g * group + row % group;
  if (part_o == nullptr) {
    a.o[out_row * a.head_dim + d] = value;
    if (d == 0) a.lse[out_row] = lse;
  } else {
    const int64_t part_row = split * a.num_tokens * a.num_q_heads + out_row;
    part_o[part_row * a.head_dim + d] = value;
    if (d == 0) part_lse[part_row] = lse;
  }
}

// grid: [row_tiles, num_kv_heads, splits]; 4 query rows per block. Warp w takes the slot tiles
// w, w + 4, ... of the block's split and reads K (lane j: row of slot j) and V (lane: its dims of
// every visible slot) straight from global memory; the 4 warp states are merged in shared memory.
template <int kDMax, typename T>
__global__ void __launch_bounds__(kAttnThreads)
    DecodeAttentionKernel(WindowAttentionArgs a, int64_t slots_per_split, float* part_o,
                          float* part_lse, float* scores) {
  constexpr int kDimsPerLane = kDMax / kWarpSize;
  __shared__ __align__(16) float qs[kRowsPerWarp * kDMax];
  __shared__ int qpos[kRowsPerWarp];
  __shared__ float warp_m[kAttnWarps][kRowsPerWarp];
  __shared__ float warp_l[kAttnWarps][kRowsPerWarp];
  __shared__ float warp_o[kAttnWarps][kRowsPerWarp][kDMax];

  const int64_t g = blockIdx.y;
  const int64_t row0 = blockIdx.x * int64_t{kRowsPerWarp};
  const int64_t split = blockIdx.z;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int head_dim = static_cast<int>(a.head_dim);
  const int64_t rows = a.num_tokens * (a.num_q_heads / a.num_kv_heads);

  LoadQueryRows<kDMax>(a, g, row0, kRowsPerWarp, qs, qpos);
  __syncthreads();
  int row_qpos[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) row_qpos[r] = qpos[r];

  const int64_t s_begin = split * slots_per_split;
  const int64_t s_end = min(a.num_slots, s_begin + slots_per_split);
  const T* k_head = static_cast<const T*>(a.k_cache) + g * a.capacity * a.head_dim;
  const T* v_head = static_cast<const T*>(a.v_cache) + g * a.capacity * a.head_dim;

  RowStates<kDMax> state;
  state.Init();
  for (int64_t base = s_begin + warp * kSlotTile; base < s_end; base += kAttnWarps * kSlotTile) {
    const int64_t s = base + lane;
    const int pos = s < s_end ? a.slot_pos[s] : -1;
    bool visible[kRowsPerWarp];
    bool any = false;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      visible[r] = pos >= 0 && pos <= row_qpos[r];
      any |= visible[r];
    }
    const bool warp_any = __any_sync(kFullMask, any);
    float score[kRowsPerWarp] = {};
    if (any) DotRows<kDMax>(k_head + s * a.head_dim, qs, head_dim, score);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) score[r] = visible[r] ? score[r] * a.scale : -INFINITY;
    if (scores != nullptr && s < s_end) {  // [num_kv_heads, rows, num_slots], coalesced along s
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        if (row0 + r < rows) scores[(g * rows + row0 + r) * a.num_slots + s] = score[r];
      }
    }
    if (!warp_any) continue;
    const int valid_rows = static_cast<int>(min(int64_t{kSlotTile}, s_end - base));
    state.Update(score, v_head + base * a.head_dim, a.head_dim, valid_rows, head_dim, lane);
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    state.l[r] = WarpSum(state.l[r]);
    if (lane == 0) {
      warp_m[warp][r] = state.m[r];
      warp_l[warp][r] = state.l[r];
    }
#pragma unroll
    for (int d = 0; d < kDimsPerLane; ++d) warp_o[warp][r][lane * kDimsPerLane + d] = state.o[r][d];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kRowsPerWarp * head_dim; i += blockDim.x) {
    const int r = i / head_dim;
    const int d = i % head_dim;
    if (row0 + r >= rows) continue;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) m = fmaxf(m, warp_m[w][r]);
    float value = 0.0f;
    float lse = -INFINITY;
    if (m != -INFINITY) {
      float l = 0.0f;
      float acc = 0.0f;
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) {
        const float c = expf(warp_m[w][r] - m);
        l = fmaf(warp_l[w][r], c, l);
        acc = fmaf(warp_o[w][r][d], c, acc);
      }
      value = acc / l;
      lse = m + logf(l);
    }
    StoreOutput(a, part_o, part_lse, split, g, row0 + r, d, value, lse);
  }
}

template <int kDMax, typename T>
constexpr size_t TiledSmemBytes() {
  return sizeof(float) * kTiledRows * kDMax +                 // qs
         2 * sizeof(T) * kSlotTile * kTileStride<kDMax, T> +  // ks, vs
         sizeof(int) * (kSlotTile + kTiledRows);              // spos, qpos
}

// grid: [row_tiles, num_kv_heads, splits]; 16 query rows per block, 4 per warp. The block stages
// 32-slot K/V tiles in shared memory (16-byte loads, coalesced along head_dim) that all 4 warps
// read; a warp skips a tile none of whose slots its rows can see (causal prefill).
template <int kDMax, typename T>
__global__ void __launch_bounds__(kAttnThreads)
    TiledAttentionKernel(WindowAttentionArgs a, int64_t slots_per_split, float* part_o,
                         float* part_lse) {
  constexpr int kDimsPerLane = kDMax / kWarpSize;
  constexpr int kStride = kTileStride<kDMax, T>;
  constexpr int kChunk = kChunkElems<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  float* qs = reinterpret_cast<float*>(smem);                    // [kTiledRows][kDMax]
  T* ks = reinterpret_cast<T*>(qs + kTiledRows * kDMax);         // [kSlotTile][kStride]
  T* vs = ks + kSlotTile * kStride;                              // [kSlotTile][kStride]
  int* spos = reinterpret_cast<int*>(vs + kSlotTile * kStride);  // [kSlotTile]
  int* qpos = spos + kSlotTile;                                  // [kTiledRows]

  const int64_t g = blockIdx.y;
  const int64_t row0 = blockIdx.x * int64_t{kTiledRows};
  const int64_t split = blockIdx.z;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int head_dim = static_cast<int>(a.head_dim);
  const int64_t rows = a.num_tokens * (a.num_q_heads / a.num_kv_heads);

  LoadQueryRows<kDMax>(a, g, row0, kTiledRows, qs, qpos);
  __syncthreads();
  int row_qpos[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) row_qpos[r] = qpos[warp * kRowsPerWarp + r];
  const float* warp_q = qs + warp * kRowsPerWarp * kDMax;

  const int64_t s_begin = split * slots_per_split;
  const int64_t s_end = min(a.num_slots, s_begin + slots_per_split);
  const T* k_head = static_cast<const T*>(a.k_cache) + g * a.capacity * a.head_dim;
  const T* v_head = static_cast<const T*>(a.v_cache) + g * a.capacity * a.head_dim;
  const int chunks_per_row = head_dim / kChunk;

  RowStates<kDMax> state;
  state.Init();
  for (int64_t base = s_begin; base < s_end; base += kSlotTile) {
    __syncthreads();  // every warp is done with the previous tile
    for (int i = threadIdx.x; i < kSlotTile * chunks_per_row; i += kAttnThreads) {
      const int j = i / chunks_per_row;
      const int c = i % chunks_per_row;
      const int64_t s = base + j;
      uint4 k_chunk = make_uint4(0, 0, 0, 0);
      uint4 v_chunk = make_uint4(0, 0, 0, 0);
      if (s < s_end) {
        k_chunk = *reinterpret_cast<const uint4*>(k_head + s * a.head_dim + c * kChunk);
        v_chunk = *reinterpret_cast<const uint4*>(v_head + s * a.head_dim + c * kChunk);
      }
      *reinterpret_cast<uint4*>(ks + j * kStride + c * kChunk) = k_chunk;
      *reinterpret_cast<uint4*>(vs + j * kStride + c * kChunk) = v_chunk;
    }
    if (threadIdx.x < kSlotTile) {
      const int64_t s = base + threadIdx.x;
      spos[threadIdx.x] = s < s_end ? a.slot_pos[s] : -1;
    }
    __syncthreads();

    const int pos = spos[lane];
    bool visible[kRowsPerWarp];
    bool any = false;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      visible[r] = pos >= 0 && pos <= row_qpos[r];
      any |= visible[r];
    }
    if (!__any_sync(kFullMask, any)) continue;
    float score[kRowsPerWarp] = {};
    if (any) DotRows<kDMax>(ks + lane * kStride, warp_q, head_dim, score);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) score[r] = visible[r] ? score[r] * a.scale : -INFINITY;
    state.Update(score, vs, kStride, kSlotTile, head_dim, lane);  // rows past s_end are zeros
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const float l = WarpSum(state.l[r]);
    const int64_t row = row0 + warp * kRowsPerWarp + r;
    if (row >= rows) continue;
    const bool empty = state.m[r] == -INFINITY;
    const float lse = empty ? -INFINITY : state.m[r] + logf(l);
#pragma unroll
    for (int d = 0; d < kDimsPerLane; ++d) {
      const int dim = lane * kDimsPerLane + d;
      if (dim < head_dim) {
        StoreOutput(a, part_o, part_lse, split, g, row, dim, empty ? 0.0f : state.o[r][d] / l, lse);
      }
    }
  }
}

constexpr int kCombineThreads = 256;
constexpr int kCombineWarps = kCombineThreads / kWarpSize;

// One block merges the `splits` partial states of output row `row`:
// o = Σ_i w_i·o_i / Σ_i w_i, lse = M + log Σ_i w_i with w_i = exp(lse_i - M), M = max_i lse_i.
// Warp w sums the splits w, w + 8, ... (lanes along head_dim, coalesced), then the 8 warp sums
// are added: short dependent chains, since the splits of one row can number in the hundreds.
// combine_smem: [splits] weights + [kCombineWarps][head_dim] warp sums; scratch: 32 floats.
__device__ __forceinline__ void CombineRow(const float* part_o, const float* part_lse,
                                           int64_t splits, int64_t rows, int64_t head_dim,
                                           float* o, float* lse, int64_t row, float* combine_smem,
                                           float* scratch) {
  float* weights = combine_smem;             // [splits]
  float* warp_sums = combine_smem + splits;  // [kCombineWarps][head_dim]
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < splits; i += blockDim.x) {
    m = fmaxf(m, part_lse[i * rows + row]);
  }
  m = BlockMax(m, scratch);
  if (m == -INFINITY) {  // block-uniform
    for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) o[row * head_dim + d] = 0.0f;
    if (threadIdx.x == 0) lse[row] = -INFINITY;
    return;
  }
  float l = 0.0f;
  for (int64_t i = threadIdx.x; i < splits; i += blockDim.x) {
    const float c = expf(part_lse[i * rows + row] - m);
    weights[i] = c;
    l += c;
  }
  l = BlockSum(l, scratch);  // its barriers also publish `weights`
  for (int64_t d = lane; d < head_dim; d += kWarpSize) {
    float acc = 0.0f;
#pragma unroll 4
    for (int64_t i = warp; i < splits; i += kCombineWarps) {
      acc = fmaf(weights[i], part_o[(i * rows + row) * head_dim + d], acc);
    }
    warp_sums[warp * head_dim + d] = acc;
  }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < kCombineWarps; ++w) acc += warp_sums[w * head_dim + d];
    o[row * head_dim + d] = acc / l;
  }
  if (threadIdx.x == 0) lse[row] = m + logf(l);
}

// grid: [T·Hq]; one block per output row (CombineRow), a programmatic dependent launch: it may
// be scheduled while the attention kernel runs. Dynamic shared memory: [splits] weights +
// [kCombineWarps][head_dim] warp sums.
__global__ void __launch_bounds__(kCombineThreads)
    CombineSplitsKernel(const float* part_o, const float* part_lse, int64_t splits, int64_t rows,
                        int64_t head_dim, float* o, float* lse) {
  extern __shared__ float combine_smem[];
  __shared__ float scratch[kWarpSize];
  WaitForPreviousKernel();  // launched as a dependent of the attention kernel
  AllowDependentLaunch();
  CombineRow(part_o, part_lse, splits, rows, head_dim, o, lse, blockIdx.x, combine_smem, scratch);
}

// grid: [max_out_rows, count]; block (r, i) combines output row r of segment i when that
// segment has split (a block past its rows, or of an unsplit segment, exits). A programmatic
// dependent launch after the batched attention kernel; the segment table was uploaded before
// that kernel, so it may be read before the wait. Dynamic shared memory as above with
// max_splits weights.
__global__ void __launch_bounds__(kCombineThreads)
    CombineSplitsBatchKernel(const DecodeBatchSegment* segments, const unsigned char* workspace) {
  extern __shared__ float combine_smem[];
  __shared__ float scratch[kWarpSize];
  const DecodeBatchSegment& segment = segments[blockIdx.y];
  const int64_t splits = segment.splits;
  const int64_t rows = segment.args.num_tokens * segment.args.num_q_heads;
  if (splits <= 1 || static_cast<int64_t>(blockIdx.x) >= rows) return;
  const int64_t head_dim = segment.args.head_dim;
  float* o = segment.args.o;
  float* lse = segment.args.lse;
  const float* part_o = reinterpret_cast<const float*>(workspace + segment.part_o_offset);
  const float* part_lse = reinterpret_cast<const float*>(workspace + segment.part_lse_offset);
  WaitForPreviousKernel();
  CombineRow(part_o, part_lse, splits, rows, head_dim, o, lse, blockIdx.x, combine_smem, scratch);
}

// Launches the decode or the tiled kernel for one (head-dim bucket, cache type).
struct AttentionLauncher {
  const WindowAttentionArgs& args;
  const WindowAttentionPlan& plan;
  dim3 grid;
  float* part_o;
  float* part_lse;
  float* scores;
  cudaStream_t stream;

  template <int kDMax, typename T>
  cudaError_t Run() const {
    if (plan.decode) {
      DecodeAttentionKernel<kDMax, T>
          <<<grid, kAttnThreads, 0, stream>>>(args, plan.slots_per_split, part_o, part_lse, scores);
      return cudaGetLastError();
    }
    constexpr size_t kSmem = TiledSmemBytes<kDMax, T>();
    const cudaError_t attr = AllowDynamicSmem(TiledAttentionKernel<kDMax, T>, kSmem);
    if (attr != cudaSuccess) return attr;
    TiledAttentionKernel<kDMax, T>
        <<<grid, kAttnThreads, kSmem, stream>>>(args, plan.slots_per_split, part_o, part_lse);
    return cudaGetLastError();
  }
};

// Resident blocks per multiprocessor of the decode or the tiled kernel for one (head-dim
// bucket, cache type), from the occupancy calculator.
struct OccupancyQuery {
  bool decode;
  int* blocks;

  template <int kDMax, typename T>
  cudaError_t Run() const {
    if (decode) {
      return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, DecodeAttentionKernel<kDMax, T>,
                                                           kAttnThreads, 0);
    }
    constexpr size_t kSmem = TiledSmemBytes<kDMax, T>();
    const cudaError_t attr = AllowDynamicSmem(TiledAttentionKernel<kDMax, T>, kSmem);
    if (attr != cudaSuccess) return attr;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, TiledAttentionKernel<kDMax, T>,
                                                         kAttnThreads, kSmem);
  }
};

// Cached per (kernel, cache type, head-dim bucket): the answer depends only on the compiled
// kernel and the architecture (one architecture per process is assumed). A race between two
// threads stores the same value twice.
cudaError_t ResidentBlocksPerSm(const WindowAttentionArgs& a, bool decode, bool mma, bool stream,
                                int* blocks) {
  if (mma) return MmaAttentionBlocksPerSm(a, /*exact=*/true, blocks);
  if (stream) return DecodeStreamBlocksPerSm(a, blocks);
  static std::atomic<int> cache[2][2][4] = {};
  const int bucket = a.head_dim <= 32 ? 0 : a.head_dim <= 64 ? 1 : a.head_dim <= 128 ? 2 : 3;
  std::atomic<int>& entry = cache[decode ? 1 : 0][a.cache_dtype == DType::kBF16 ? 1 : 0][bucket];
  *blocks = entry.load(std::memory_order_relaxed);
  if (*blocks > 0) return cudaSuccess;
  const cudaError_t error =
      DispatchAttention(a.head_dim, a.cache_dtype, OccupancyQuery{decode, blocks});
  if (error != cudaSuccess) return error;
  entry.store(*blocks, std::memory_order_relaxed);
  return cudaSuccess;
}

}  // namespace

cudaError_t PlanWindowAttention(const WindowAttentionArgs& a, int num_sms,
                                WindowAttentionPlan* plan, bool allow_tensor_cores,
                                bool exact_prefill, int decode_waves) {
  *plan = WindowAttentionPlan();
  const int64_t rows = a.num_tokens * (a.num_q_heads / a.num_kv_heads);
  const bool stream_ok = allow_tensor_cores && DecodeStreamSupports(a);
  plan->decode = rows <= kDecodeMaxRows || (stream_ok && rows <= kDecodeStreamRows);
  plan->stream = plan->decode && stream_ok;
  plan->mma = !plan->decode && allow_tensor_cores && MmaAttentionSupports(a);
  plan->flash = plan->mma && !exact_prefill && FlashAttentionSupports(a);
  plan->flash_variant = plan->flash ? PreferredFlashVariant(a) : kFlashDefaultVariant;
  const int64_t rows_per_block = plan->stream   ? kDecodeStreamRows
                                 : plan->decode ? kRowsPerWarp
                                 : plan->flash  ? kFlashRowsPerBlock
                                 : plan->mma    ? kMmaRowsPerBlock
                                                : kTiledRows;
  const int64_t slot_tile = plan->mma ? kMmaSlotTile : kSlotTile;
  plan->row_tiles = (rows + rows_per_block - 1) / rows_per_block;
  int blocks_per_sm = 0;
  const cudaError_t error =
      plan->flash ? FlashAttentionBlocksPerSm(a, plan->flash_variant, &blocks_per_sm)
                  : ResidentBlocksPerSm(a, plan->decode, plan->mma, plan->stream, &blocks_per_sm);
  if (error != cudaSuccess) return error;
  // Split the slots until one wave of resident blocks is full (a partial second wave would cost
  // as much as a full one); a split keeps at least two slot tiles per warp so the partial states
  // stay cheap next to the work.
  const int64_t base_blocks = plan->row_tiles * a.num_kv_heads;
  // Decode plans aim at decode_waves waves instead (kDecodeWaves unless a benchmark sweeps it).
  const int64_t waves = plan->decode ? (decode_waves > 0 ? decode_waves : kDecodeWaves) : 1;
  const int64_t wave = int64_t{std::max(num_sms, 1)} * std::max(blocks_per_sm, 1) * waves;
  const int64_t min_slots = 2 * slot_tile * (plan->decode ? kAttnWarps : 1);
  const int64_t max_splits =
      std::clamp<int64_t>((a.num_slots + min_slots - 1) / min_slots, 1, kMaxSplits);
  const int64_t splits = std::clamp<int64_t>(wave / base_blocks, 1, max_splits);
  const int64_t per_split = (a.num_slots + splits - 1) / splits;
  plan->slots_per_split = (per_split + slot_tile - 1) / slot_tile * slot_tile;
  plan->splits = (a.num_slots + plan->slots_per_split - 1) / plan->slots_per_split;
  size_t bytes = 0;
  if (plan->splits > 1) {
    const size_t states = static_cast<size_t>(plan->splits * a.num_tokens * a.num_q_heads);
    plan->part_lse_offset = AlignUp(states * a.head_dim * sizeof(float));
    bytes = AlignUp(plan->part_lse_offset + states * sizeof(float));
  }
  // The MAW update reads saved scores instead of recomputing them from the K cache where the
  // buffer stays small: decode plans, and tensor-core plans of one row tile of <= 32 rows
  // (a few decode tokens), whose scores cost fewer bytes than the K rows they replace.
  plan->save_scores = a.maw != nullptr &&
                      (plan->decode || (plan->mma && plan->row_tiles == 1 && rows <= 32));
  if (plan->save_scores) {
    plan->scores_offset = bytes;
    bytes += static_cast<size_t>(a.num_kv_heads * rows * a.num_slots) * sizeof(float);
  }
  if (plan->mma) {
    plan->tile_min_offset = AlignUp(bytes);
    bytes = plan->tile_min_offset + MmaTileSummaryBytes(a.num_slots);
  }
  plan->workspace_bytes = bytes;
  return cudaSuccess;
}

cudaError_t LaunchWindowAttention(const WindowAttentionArgs& a, const WindowAttentionPlan& plan,
                                  void* workspace, cudaStream_t stream) {
  if (plan.row_tiles <= 0 || plan.splits <= 0 || a.num_kv_heads <= 0) return cudaErrorInvalidValue;
  const int64_t out_rows = a.num_tokens * a.num_q_heads;
  if ((plan.splits > 1 || plan.save_scores || plan.mma) && workspace == nullptr) {
    return cudaErrorInvalidValue;
  }
  char* base = static_cast<char*>(workspace);
  float* part_o = plan.splits > 1 ? reinterpret_cast<float*>(base) : nullptr;
  float* part_lse =
      plan.splits > 1 ? reinterpret_cast<float*>(base + plan.part_lse_offset) : nullptr;
  float* scores = plan.save_scores ? reinterpret_cast<float*>(base + plan.scores_offset) : nullptr;
  const AttentionLauncher launcher{
      a,
      plan,
      dim3(static_cast<unsigned>(plan.row_tiles), static_cast<unsigned>(a.num_kv_heads),
           static_cast<unsigned>(plan.splits)),
      part_o,
      part_lse,
      scores,
      stream};
  cudaError_t error = cudaSuccess;
  if (plan.flash) {
    error = LaunchFlashAttention(a, plan.flash_variant, plan.row_tiles, plan.splits,
                                 plan.slots_per_split,
                                 reinterpret_cast<int32_t*>(base + plan.tile_min_offset), part_o,
                                 part_lse, stream);
  } else if (plan.mma) {
    error = LaunchMmaAttention(a, plan.row_tiles, plan.splits, plan.slots_per_split,
                               plan.exact_operands,
                               reinterpret_cast<int32_t*>(base + plan.tile_min_offset), part_o,
                               part_lse, scores, stream);
  } else if (plan.stream) {
    error = LaunchDecodeStream(a, plan.row_tiles, plan.splits, plan.slots_per_split, part_o,
                               part_lse, scores, stream);
    if (DecodeStreamMergeCounters(a, plan.row_tiles, plan.splits) != nullptr) return error;
  } else {
    error = DispatchAttention(a.head_dim, a.cache_dtype, launcher);
  }
  if (error != cudaSuccess || plan.splits == 1) return error;
  const size_t smem = sizeof(float) * static_cast<size_t>(plan.splits + kCombineWarps * a.head_dim);
  return LaunchAfterPrevious(CombineSplitsKernel, dim3(static_cast<unsigned>(out_rows)),
                             dim3(kCombineThreads), smem, stream, part_o, part_lse, plan.splits,
                             out_rows, a.head_dim, a.o, a.lse);
}

bool WindowAttentionBatchable(const WindowAttentionArgs& a) {
  return a.maw == nullptr && a.num_kv_heads > 0 && DecodeStreamSupports(a) &&
         a.num_tokens * (a.num_q_heads / a.num_kv_heads) <= kDecodeStreamRows;
}

cudaError_t PlanWindowAttentionBatch(DecodeBatchSegment* segments, int64_t count, int num_sms,
                                     WindowAttentionBatchPlan* plan) {
  *plan = WindowAttentionBatchPlan();
  if (segments == nullptr || count <= 0) return cudaErrorInvalidValue;
  const WindowAttentionArgs& first = segments[0].args;
  const bool small_dims = first.head_dim <= 64;
  int64_t total_slots = 0;  // Σ num_slots · num_kv_heads: the work, in slot rows
  for (int64_t i = 0; i < count; ++i) {
    const WindowAttentionArgs& a = segments[i].args;
    if (!WindowAttentionBatchable(a) || a.num_kv_heads != first.num_kv_heads ||
        (a.head_dim <= 64) != small_dims || a.num_slots < 0) {
      return cudaErrorInvalidValue;
    }
    total_slots += a.num_slots * a.num_kv_heads;
    plan->head_dim = std::max(plan->head_dim, a.head_dim);
  }
  int blocks_per_sm = 0;
  const cudaError_t error = DecodeStreamBlocksPerSm(first, &blocks_per_sm);
  if (error != cudaSuccess) return error;
  // One slot chunk for every segment, sized so that all blocks together make kBatchWaves waves:
  // equal-sized blocks balance across the multiprocessors whatever the mix of window lengths
  // (one block per segment and kv head would leave the longest windows running alone at the
  // end). A chunk keeps at least two slot tiles per warp, as in PlanWindowAttention.
  constexpr int64_t kBatchWaves = 4;
  const int64_t wave = int64_t{std::max(num_sms, 1)} * std::max(blocks_per_sm, 1);
  const int64_t min_slots = 2 * kSlotTile * kAttnWarps;
  const int64_t chunk = std::max(min_slots, (total_slots + kBatchWaves * wave - 1) /
                                                (kBatchWaves * wave));
  plan->count = count;
  plan->num_kv_heads = first.num_kv_heads;
  plan->table_bytes = AlignUp(static_cast<size_t>(count) * sizeof(DecodeBatchSegment));
  size_t bytes = plan->table_bytes;
  for (int64_t i = 0; i < count; ++i) {
    DecodeBatchSegment& seg = segments[i];
    const WindowAttentionArgs& a = seg.args;
    int64_t splits = std::clamp<int64_t>((a.num_slots + chunk - 1) / chunk, 1, kMaxSplits);
    const int64_t per_split = std::max<int64_t>((a.num_slots + splits - 1) / splits, 1);
    seg.slots_per_split = (per_split + kSlotTile - 1) / kSlotTile * kSlotTile;
    splits = std::max<int64_t>((a.num_slots + seg.slots_per_split - 1) / seg.slots_per_split, 1);
    seg.splits = splits;
    seg.part_o_offset = 0;
    seg.part_lse_offset = 0;
    plan->max_splits = std::max(plan->max_splits, splits);
    if (splits == 1) continue;
    const int64_t out_rows = a.num_tokens * a.num_q_heads;
    const size_t states = static_cast<size_t>(splits * out_rows);
    seg.part_o_offset = static_cast<int64_t>(bytes);
    bytes = AlignUp(bytes + states * a.head_dim * sizeof(float));
    seg.part_lse_offset = static_cast<int64_t>(bytes);
    bytes = AlignUp(bytes + states * sizeof(float));
    plan->max_out_rows = std::max(plan->max_out_rows, out_rows);
  }
  plan->workspace_bytes = bytes;
  // The kernel merges the splits itself when every segment has the same counters, with room for
  // one per (segment, kv head).
  plan->fused_merge = first.split_counters != nullptr && plan->max_splits <= kMaxFusedSplits &&
                      count * first.num_kv_heads <= first.split_counter_count;
  for (int64_t i = 1; i < count && plan->fused_merge; ++i) {
    plan->fused_merge = segments[i].args.split_counters == first.split_counters;
  }
  return cudaSuccess;
}

cudaError_t LaunchWindowAttentionBatch(const WindowAttentionBatchPlan& plan, void* workspace,
                                       cudaStream_t stream) {
  if (workspace == nullptr || plan.count <= 0) return cudaErrorInvalidValue;
  const auto* table = static_cast<const DecodeBatchSegment*>(workspace);
  cudaError_t error =
      LaunchDecodeStreamBatch(table, plan.count, plan.max_splits, plan.num_kv_heads,
                              plan.head_dim, workspace, plan.fused_merge, stream);
  if (error != cudaSuccess || plan.max_out_rows == 0 || plan.fused_merge) return error;
  const size_t smem =
      sizeof(float) * static_cast<size_t>(plan.max_splits + kCombineWarps * plan.head_dim);
  return LaunchAfterPrevious(
      CombineSplitsBatchKernel,
      dim3(static_cast<unsigned>(plan.max_out_rows), static_cast<unsigned>(plan.count)),
      dim3(kCombineThreads), smem, stream, table,
      static_cast<const unsigned char*>(workspace));
}

}  // namespace tandem::gpu_worker::cuda_backend
