// Device code shared by the window attention kernels and the MAW update: K/V chunk loads with
// conversion to f32, the per-lane dot products of one key against a warp's query rows, the
// online-softmax update of one 32-slot tile, and kernel dispatch over (head-dim bucket, cache
// type). The score arithmetic lives only here, so the MAW kernel recomputes bit-identical
// scores to the ones the LSE was built from.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "device_utils.cuh"
#include "window_attention.cuh"

namespace tandem::gpu_worker::cuda_backend {

inline constexpr int kAttnWarps = 4;
inline constexpr int kAttnThreads = kAttnWarps * kWarpSize;
inline constexpr int kRowsPerWarp = 4;       // query rows whose scores one lane computes together
inline constexpr int kSlotTile = kWarpSize;  // slots per warp step: lane j owns slot j

// Elements of T in one 16-byte chunk.
template <typename T>
inline constexpr int kChunkElems = 16 / static_cast<int>(sizeof(T));

// Row stride (elements) of a K/V tile in shared memory: one 16-byte pad per row, so the 8 lanes
// of a 16-byte-load phase that read 8 different rows hit 8 disjoint bank groups.
template <int kDMax, typename T>
inline constexpr int kTileStride = kDMax + kChunkElems<T>;

__device__ __forceinline__ void LoadChunk(const float* p, float (&v)[4]) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  v[0] = x.x;
  v[1] = x.y;
  v[2] = x.z;
  v[3] = x.w;
}

__device__ __forceinline__ float Bf16LoToFloat(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float Bf16HiToFloat(uint32_t w) {
  return __uint_as_float(w & 0xffff0000u);
}

__device__ __forceinline__ void LoadChunk(const __nv_bfloat16* p, float (&v)[8]) {
  const uint4 x = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = Bf16LoToFloat(w[i]);
    v[2 * i + 1] = Bf16HiToFloat(w[i]);
  }
}

// Loads N consecutive elements (N·sizeof(T) bytes, naturally aligned) as f32.
template <int N>
__device__ __forceinline__ void LoadVec(const float* p, float (&v)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 x = reinterpret_cast<const float4*>(p)[i];
      v[4 * i] = x.x;
      v[4 * i + 1] = x.y;
      v[4 * i + 2] = x.z;
      v[4 * i + 3] = x.w;
    }
  } else if constexpr (N == 2) {
    const float2 x = *reinterpret_cast<const float2*>(p);
    v[0] = x.x;
    v[1] = x.y;
  } else {
    static_assert(N == 1);
    v[0] = *p;
  }
}

template <int N>
__device__ __forceinline__ void LoadVec(const __nv_bfloat16* p, float (&v)[N]) {
  if constexpr (N == 8) {
    LoadChunk(p, v);
  } else if constexpr (N == 4) {
    const uint2 x = *reinterpret_cast<const uint2*>(p);
    v[0] = Bf16LoToFloat(x.x);
    v[1] = Bf16HiToFloat(x.x);
    v[2] = Bf16LoToFloat(x.y);
    v[3] = Bf16HiToFloat(x.y);
  } else if constexpr (N == 2) {
    const uint32_t x = *reinterpret_cast<const uint32_t*>(p);
    v[0] = Bf16LoToFloat(x);
    v[1] = Bf16HiToFloat(x);
  } else {
    static_assert(N == 1);
    v[0] = __bfloat162float(*p);
  }
}

// s[r] = Σ_d q[r, d]·k[d] for the kRowsPerWarp rows of `q` (shared memory, [kRowsPerWarp][kDMax]
// f32; reads are warp-wide broadcasts) and one key row `k` (shared or global memory, 16-byte
// aligned). Only the first head_dim elements are read.
template <int kDMax, typename T>
__device__ __forceinline__ void DotRows(const T* k, const float* q, int head_dim,
                                        float (&s)[kRowsPerWarp]) {
  constexpr int kChunk = kChunkElems<T>;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) s[r] = 0.0f;
#pragma unroll
  for (int c = 0; c < kDMax / kChunk; ++c) {
    if (c * kChunk < head_dim) {
      float kv[kChunk];
      LoadChunk(k + c * kChunk, kv);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float4* q4 = reinterpret_cast<const float4*>(q + r * kDMax + c * kChunk);
#pragma unroll
        for (int i = 0; i < kChunk / 4; ++i) {
          const float4 qv = q4[i];
          s[r] = fmaf(qv.x, kv[4 * i], s[r]);
          s[r] = fmaf(qv.y, kv[4 * i + 1], s[r]);
          s[r] = fmaf(qv.z, kv[4 * i + 2], s[r]);
          s[r] = fmaf(qv.w, kv[4 * i + 3], s[r]);
        }
      }
    }
  }
}

// Running softmax state of a warp's kRowsPerWarp rows: m (max score, uniform across the warp),
// l (this lane's share of Σ exp(score - m); summed over the warp at the end) and o (unnormalised
// Σ exp(score - m)·v over this lane's kDMax/32 dims).
template <int kDMax>
struct RowStates {
  static constexpr int kDimsPerLane = kDMax / kWarpSize;
  float m[kRowsPerWarp];
  float l[kRowsPerWarp];
  float o[kRowsPerWarp][kDimsPerLane];

  __device__ __forceinline__ void Init() {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      m[r] = -INFINITY;
      l[r] = 0.0f;
#pragma unroll
      for (int d = 0; d < kDimsPerLane; ++d) o[r][d] = 0.0f;
    }
  }

  // Folds in one tile of 32 slots: lane j holds score[r] of slot j (-inf = not visible);
  // v_tile row j (stride v_stride elements) is slot j's value row. Rows >= valid_rows may not be
  // readable (past the cache); their scores must be -inf.
  //
  // NOTE: V rows are read kVBatch at a time with no branch between the loads, so a warp keeps
  // kVBatch loads in flight. A slot that
  // no row weighs is skipped (warp-uniform branch on a ballot bit), so an empty slot's
  // unwritten (possibly NaN) V row never reaches o; a weighed slot is visible to some row, so
  // its V row was written and is finite, and a zero weight for another row adds 0.
  template <typename T>
  __device__ __forceinline__ void Update(const float (&score)[kRowsPerWarp], const T* v_tile,
                                         int64_t v_stride, int valid_rows, int head_dim, int lane) {
    constexpr int kVBatch = 8;
    float p[kRowsPerWarp];
    bool weighted = false;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const float m_new = fmaxf(m[r], WarpMax(score[r]));
      if (m_new == -INFINITY) {  // nothing visible to this row yet (warp-uniform)
        p[r] = 0.0f;
        continue;
      }
      const float correction = expf(m[r] - m_new);  // m = -inf: 0, and o, l are still 0
      p[r] = expf(score[r] - m_new);                // score = -inf: 0
      l[r] = l[r] * correction + p[r];
#pragma unroll
      for (int d = 0; d < kDimsPerLane; ++d) o[r][d] *= correction;
      m[r] = m_new;
      weighted |= p[r] != 0.0f;
    }
    const unsigned weighted_slots = __ballot_sync(kFullMask, weighted);
    const bool active = lane * kDimsPerLane < head_dim;
    for (int j0 = 0; j0 < kSlotTile; j0 += kVBatch) {
      if (((weighted_slots >> j0) & ((1u << kVBatch) - 1)) == 0) continue;  // warp-uniform
      float v[kVBatch][kDimsPerLane];
#pragma unroll
      for (int u = 0; u < kVBatch; ++u) {
        const int j = min(j0 + u, valid_rows - 1);
        if (active) {
          LoadVec<kDimsPerLane>(v_tile + j * v_stride + lane * kDimsPerLane, v[u]);
        } else {
#pragma unroll
          for (int d = 0; d < kDimsPerLane; ++d) v[u][d] = 0.0f;
        }
      }
#pragma unroll
      for (int u = 0; u < kVBatch; ++u) {
        if (((weighted_slots >> (j0 + u)) & 1u) == 0) continue;  // warp-uniform
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          const float pj = __shfl_sync(kFullMask, p[r], j0 + u);
#pragma unroll
          for (int d = 0; d < kDimsPerLane; ++d) o[r][d] = fmaf(pj, v[u][d], o[r][d]);
        }
      }
    }
  }
};

// Query rows [row0, row0 + n) of kv head g into shared memory `qs` ([n][kDMax] f32, zero past
// head_dim and for rows past T·G) and their positions into `qpos` (-1 for rows past T·G, which
// makes every slot invisible to them). Called by all threads of the block.
template <int kDMax>
__device__ __forceinline__ void LoadQueryRows(const WindowAttentionArgs& a, int64_t g, int64_t row0,
                                              int n, float* qs, int* qpos) {
  const int64_t group = a.num_q_heads / a.num_kv_heads;
  const int64_t rows = a.num_tokens * group;
  for (int i = threadIdx.x; i < n * kDMax; i += blockDim.x) {
    const int r = i / kDMax;
    const int d = i % kDMax;
    const int64_t row = row0 + r;
    float value = 0.0f;
    if (row < rows && d < a.head_dim) {
      const int64_t t = row / group;
      const int64_t h = g * group + row % group;
      value = a.q[t * a.q_row_stride + h * a.head_dim + d];
    }
    qs[i] = value;
  }
  for (int r = threadIdx.x; r < n; r += blockDim.x) {
    const int64_t row = row0 + r;
    qpos[r] = row < rows ? a.q_pos[row / group] : -1;
  }
}

// Calls launch.template Run<kDMax, T>() for the smallest head-dim bucket kDMax holding
// head_dim and the cache's element type T.
template <typename T, typename Launch>
cudaError_t DispatchHeadDim(int64_t head_dim, const Launch& launch) {
  if (head_dim <= 32) return launch.template Run<32, T>();
  if (head_dim <= 64) return launch.template Run<64, T>();
  if (head_dim <= 128) return launch.template Run<128, T>();
  if (head_dim <= 256) return launch.template Run<256, T>();
  return cudaErrorInvalidValue;
}

template <typename Launch>
cudaError_t DispatchAttention(int64_t head_dim, DType cache_dtype, const Launch& launch) {
  switch (cache_dtype) {
    case DType::kF32:
      return DispatchHeadDim<float>(head_dim, launch);
    case DType::kBF16:
      return DispatchHeadDim<__nv_bfloat16>(head_dim, launch);
    default:
      return cudaErrorInvalidValue;
  }
}

// Raises a kernel's dynamic shared memory limit when it needs more than the default 48 KiB.
template <typename Kernel>
cudaError_t AllowDynamicSmem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

}  // namespace tandem::gpu_worker::cuda_backend
