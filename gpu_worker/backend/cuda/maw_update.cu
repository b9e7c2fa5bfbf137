// MAW update (HGCA Alg. 1 line 8) after window attention: weighs every score with the final LSE,
// from the scores the decode kernel saved or recomputed with the attention kernels' DotRows.
#include "attention_common.cuh"
#include "window_attention.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

template <int kDMax, typename T>
constexpr size_t MawSmemBytes() {
  return sizeof(T) * kSlotTile * kTileStride<kDMax, T> +      // ks
         sizeof(float) * kAttnWarps * kRowsPerWarp * kDMax +  // qs (per warp)
         sizeof(float) * kAttnWarps * kSlotTile +             // per-warp sums
         sizeof(int) * kSlotTile;                             // spos
}

// grid: [ceil(num_slots / 32), num_kv_heads]. The block stages the K rows of its 32 slots in
// shared memory; warp w loops over the query rows w·4, w·4 + 16, ... of the group, 4 at a time
// (DotRows computes each row's score on its own, so the grouping does not change the bits); lane
// j sums exp(score - lse) for slot j. Warp 0 adds the 4 warp sums and folds the mean into maw.
template <int kDMax, typename T>
__global__ void __launch_bounds__(kAttnThreads) MawUpdateKernel(WindowAttentionArgs a) {
  constexpr int kStride = kTileStride<kDMax, T>;
  constexpr int kChunk = kChunkElems<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem);                                 // [kSlotTile][kStride]
  float* qs = reinterpret_cast<float*>(ks + kSlotTile * kStride);     // [warps][4][kDMax]
  float* sums = qs + kAttnWarps * kRowsPerWarp * kDMax;               // [warps][kSlotTile]
  int* spos = reinterpret_cast<int*>(sums + kAttnWarps * kSlotTile);  // [kSlotTile]

  const int64_t g = blockIdx.y;
  const int64_t base = blockIdx.x * int64_t{kSlotTile};
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int head_dim = static_cast<int>(a.head_dim);
  const int64_t group = a.num_q_heads / a.num_kv_heads;
  const int64_t rows = a.num_tokens * group;
  const T* k_head = static_cast<const T*>(a.k_cache) + g * a.capacity * a.head_dim;
  const int chunks_per_row = head_dim / kChunk;

  for (int i = threadIdx.x; i < kSlotTile * chunks_per_row; i += kAttnThreads) {
    const int j = i / chunks_per_row;
    const int c = i % chunks_per_row;
    const int64_t s = base + j;
    uint4 chunk = make_uint4(0, 0, 0, 0);
    if (s < a.num_slots) {
      chunk = *reinterpret_cast<const uint4*>(k_head + s * a.head_dim + c * kChunk);
    }
    *reinterpret_cast<uint4*>(ks + j * kStride + c * kChunk) = chunk;
  }
  if (threadIdx.x < kSlotTile) {
    const int64_t s = base + threadIdx.x;
    spos[threadIdx.x] = s < a.num_slots ? a.slot_pos[s] : -1;
  }
  __syncthreads();

  const int pos = spos[lane];
  float* warp_q = qs + warp * kRowsPerWarp * kDMax;
  float sum = 0.0f;
  for (int64_t row0 = warp * kRowsPerWarp; row0 < rows; row0 += kAttnWarps * kRowsPerWarp) {
    __syncwarp();  // the previous rows' reads of warp_q are done
    for (int i = lane; i < kRowsPerWarp * kDMax; i += kWarpSize) {
      const int r = i / kDMax;
      const int d = i % kDMax;
      const int64_t row = row0 + r;
      float value = 0.0f;
      if (row < rows && d < head_dim) {
        value = a.q[(row / group) * a.q_row_stride + (g * group + row % group) * a.head_dim + d];
      }
      warp_q[i] = value;
    }
    int row_qpos[kRowsPerWarp];
    float row_lse[kRowsPerWarp];
    bool visible[kRowsPerWarp];
    bool any = false;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int64_t row = row0 + r;
      row_qpos[r] = -1;
      row_lse[r] = -INFINITY;
      if (row < rows) {
        const int64_t t = row / group;
        row_qpos[r] = a.q_pos[t];
        row_lse[r] = a.lse[t * a.num_q_heads + g * group + row % group];
      }
      visible[r] = pos >= 0 && pos <= row_qpos[r] && row_lse[r] != -INFINITY;
      any |= visible[r];
    }
    __syncwarp();  // warp_q is written
    if (any) {
      float score[kRowsPerWarp];
      DotRows<kDMax>(ks + lane * kStride, warp_q, head_dim, score);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        if (visible[r]) sum += expf(score[r] * a.scale - row_lse[r]);
      }
    }
  }
  sums[warp * kSlotTile + lane] = sum;
  __syncthreads();
  if (warp == 0) {
    const int64_t s = base + lane;
    if (s < a.num_slots && pos >= 0) {
      float total = 0.0f;
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) total += sums[w * kSlotTile + lane];
      const float mean = total / static_cast<float>(rows);
      float* maw = a.maw + g * a.capacity + s;
      const float old = *maw;
      *maw = old < 0.0f ? mean : (1.0f - a.alpha) * old + a.alpha * mean;
    }
  }
}

// grid: [ceil(num_slots / 256), num_kv_heads], one thread per slot: the attention kernel saved
// the (row, slot) scores ([num_kv_heads, rows, num_slots]; visible pairs only are read), so the
// weights
// are exp(score - lse) without touching the K cache. A programmatic dependent launch.
__global__ void MawFromScoresKernel(WindowAttentionArgs a, const float* scores) {
  WaitForPreviousKernel();  // launched as a dependent of the attention (or combine) kernel
  const int64_t g = blockIdx.y;
  const int64_t s = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (s >= a.num_slots) return;
  const int pos = a.slot_pos[s];
  if (pos < 0) return;
  const int64_t group = a.num_q_heads / a.num_kv_heads;
  const int64_t rows = a.num_tokens * group;
  float sum = 0.0f;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = row / group;
    // Visibility from the positions: a kernel may leave the scores of slots no row of its
    // block sees unwritten. A visible slot makes the row's lse finite.
    if (pos > a.q_pos[t]) continue;
    const float score = scores[(g * rows + row) * a.num_slots + s];
    sum += expf(score - a.lse[t * a.num_q_heads + g * group + row % group]);
  }
  const float mean = sum / static_cast<float>(rows);
  float* maw = a.maw + g * a.capacity + s;
  const float old = *maw;
  *maw = old < 0.0f ? mean : (1.0f - a.alpha) * old + a.alpha * mean;
}

struct MawLauncher {
  const WindowAttentionArgs& args;
  dim3 grid;
  cudaStream_t stream;

  template <int kDMax, typename T>
  cudaError_t Run() const {
    constexpr size_t kSmem = MawSmemBytes<kDMax, T>();
    const cudaError_t attr = AllowDynamicSmem(MawUpdateKernel<kDMax, T>, kSmem);
    if (attr != cudaSuccess) return attr;
    MawUpdateKernel<kDMax, T><<<grid, kAttnThreads, kSmem, stream>>>(args);
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t LaunchMawUpdate(const WindowAttentionArgs& a, const WindowAttentionPlan& plan,
                            const void* workspace, cudaStream_t stream) {
  if (a.num_slots <= 0 || a.num_kv_heads <= 0 || a.maw == nullptr) return cudaErrorInvalidValue;
  if (plan.save_scores) {
    if (workspace == nullptr) return cudaErrorInvalidValue;
    constexpr int kThreads = 256;
    const dim3 grid(static_cast<unsigned>((a.num_slots + kThreads - 1) / kThreads),
                    static_cast<unsigned>(a.num_kv_heads));
    return LaunchAfterPrevious(
        MawFromScoresKernel, grid, dim3(kThreads), 0, stream, a,
        reinterpret_cast<const float*>(static_cast<const char*>(workspace) + plan.scores_offset));
  }
  const dim3 grid(static_cast<unsigned>((a.num_slots + kSlotTile - 1) / kSlotTile),
                  static_cast<unsigned>(a.num_kv_heads));
  return DispatchAttention(a.head_dim, a.cache_dtype, MawLauncher{a, grid, stream});
}

}  // namespace tandem::gpu_worker::cuda_backend
