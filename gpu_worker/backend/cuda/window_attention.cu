#include <algorithm>

#include "attention_common.cuh"
#include "window_attention.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

// Query rows (T·G) up to which the decode kernel (4 rows per block) is used.
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
                          float* part_lse) {
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
    if (!__any_sync(kFullMask, any)) continue;
    float score[kRowsPerWarp] = {};
    if (any) DotRows<kDMax>(k_head + s * a.head_dim, qs, head_dim, score);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) score[r] = visible[r] ? score[r] * a.scale : -INFINITY;
    state.Update(score, v_head + base * a.head_dim, a.head_dim, head_dim, lane);
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
    state.Update(score, vs, kStride, head_dim, lane);
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

// grid: [ceil(T·Hq / 4)]; one warp per output row merges the `splits` partial states:
// o = Σ_i w_i·o_i / Σ_i w_i, lse = M + log Σ_i w_i with w_i = exp(lse_i - M), M = max_i lse_i.
// Dynamic shared memory: [kAttnWarps][splits] weights.
__global__ void __launch_bounds__(kAttnThreads)
    CombineSplitsKernel(const float* part_o, const float* part_lse, int64_t splits, int64_t rows,
                        int64_t head_dim, float* o, float* lse) {
  extern __shared__ float weights[];
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = blockIdx.x * int64_t{kAttnWarps} + warp;
  if (row >= rows) return;  // warp-uniform
  float* w = weights + warp * splits;
  float m = -INFINITY;
  for (int64_t i = lane; i < splits; i += kWarpSize) m = fmaxf(m, part_lse[i * rows + row]);
  m = WarpMax(m);
  if (m == -INFINITY) {
    for (int64_t d = lane; d < head_dim; d += kWarpSize) o[row * head_dim + d] = 0.0f;
    if (lane == 0) lse[row] = -INFINITY;
    return;
  }
  float l = 0.0f;
  for (int64_t i = lane; i < splits; i += kWarpSize) {
    const float c = expf(part_lse[i * rows + row] - m);
    w[i] = c;
    l += c;
  }
  l = WarpSum(l);
  __syncwarp();
  for (int64_t d = lane; d < head_dim; d += kWarpSize) {
    float acc = 0.0f;
    for (int64_t i = 0; i < splits; ++i)
      acc = fmaf(w[i], part_o[(i * rows + row) * head_dim + d], acc);
    o[row * head_dim + d] = acc / l;
  }
  if (lane == 0) lse[row] = m + logf(l);
}

// Launches the decode or the tiled kernel for one (head-dim bucket, cache type).
struct AttentionLauncher {
  const WindowAttentionArgs& args;
  const WindowAttentionPlan& plan;
  dim3 grid;
  float* part_o;
  float* part_lse;
  cudaStream_t stream;

  template <int kDMax, typename T>
  cudaError_t Run() const {
    if (plan.decode) {
      DecodeAttentionKernel<kDMax, T>
          <<<grid, kAttnThreads, 0, stream>>>(args, plan.slots_per_split, part_o, part_lse);
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

}  // namespace

WindowAttentionPlan PlanWindowAttention(const WindowAttentionArgs& a, int num_sms) {
  WindowAttentionPlan plan;
  const int64_t rows = a.num_tokens * (a.num_q_heads / a.num_kv_heads);
  plan.decode = rows <= kDecodeMaxRows;
  const int64_t rows_per_block = plan.decode ? kRowsPerWarp : kTiledRows;
  plan.row_tiles = (rows + rows_per_block - 1) / rows_per_block;
  // Enough blocks for several waves of resident blocks; a split keeps at least two slot tiles
  // per warp so the partial states stay cheap next to the work.
  const int64_t base_blocks = plan.row_tiles * a.num_kv_heads;
  const int64_t target_blocks = int64_t{std::max(num_sms, 1)} * (plan.decode ? 8 : 4);
  const int64_t min_slots = 2 * kSlotTile * (plan.decode ? kAttnWarps : 1);
  const int64_t max_splits =
      std::clamp<int64_t>((a.num_slots + min_slots - 1) / min_slots, 1, kMaxSplits);
  int64_t splits =
      std::clamp<int64_t>((target_blocks + base_blocks - 1) / base_blocks, 1, max_splits);
  const int64_t per_split = (a.num_slots + splits - 1) / splits;
  plan.slots_per_split = (per_split + kSlotTile - 1) / kSlotTile * kSlotTile;
  plan.splits = (a.num_slots + plan.slots_per_split - 1) / plan.slots_per_split;
  if (plan.splits > 1) {
    const size_t states = static_cast<size_t>(plan.splits * a.num_tokens * a.num_q_heads);
    plan.workspace_bytes = AlignUp(states * a.head_dim * sizeof(float)) + states * sizeof(float);
  }
  return plan;
}

cudaError_t LaunchWindowAttention(const WindowAttentionArgs& a, const WindowAttentionPlan& plan,
                                  void* workspace, cudaStream_t stream) {
  if (plan.row_tiles <= 0 || plan.splits <= 0 || a.num_kv_heads <= 0) return cudaErrorInvalidValue;
  float* part_o = nullptr;
  float* part_lse = nullptr;
  const int64_t out_rows = a.num_tokens * a.num_q_heads;
  if (plan.splits > 1) {
    if (workspace == nullptr) return cudaErrorInvalidValue;
    part_o = static_cast<float*>(workspace);
    part_lse = reinterpret_cast<float*>(
        static_cast<char*>(workspace) +
        AlignUp(static_cast<size_t>(plan.splits * out_rows * a.head_dim) * sizeof(float)));
  }
  const AttentionLauncher launcher{
      a,
      plan,
      dim3(static_cast<unsigned>(plan.row_tiles), static_cast<unsigned>(a.num_kv_heads),
           static_cast<unsigned>(plan.splits)),
      part_o,
      part_lse,
      stream};
  const cudaError_t error = DispatchAttention(a.head_dim, a.cache_dtype, launcher);
  if (error != cudaSuccess || plan.splits == 1) return error;
  const int64_t blocks = (out_rows + kAttnWarps - 1) / kAttnWarps;
  const size_t smem = sizeof(float) * kAttnWarps * static_cast<size_t>(plan.splits);
  CombineSplitsKernel<<<static_cast<unsigned>(blocks), kAttnThreads, smem, stream>>>(
      part_o, part_lse, plan.splits, out_rows, a.head_dim, a.o, a.lse);
  return cudaGetLastError();
}

}  // namespace tandem::gpu_worker::cuda_backend
