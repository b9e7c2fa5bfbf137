// KeyGram (a 32x32 tile of Σ k·kᵀ per block) and ProjectKeys (one warp per 4 keys, lanes over
// the rank): the basis and the coordinates of the low-rank keys (key_projection.cuh).
#include <cfloat>
#include <cstdint>

#include "device_utils.cuh"
#include "key_projection.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kGramTile = 32;
constexpr int kGramRowsPerThread = 4;
constexpr int kGramThreads = kGramTile * kGramTile / kGramRowsPerThread;

constexpr int kProjectWarps = 8;
constexpr int kProjectKeysPerWarp = 4;
constexpr int kProjectRanksPerPass = 256;  // 8 coordinates per lane
constexpr int kProjectPerLane = kProjectRanksPerPass / kWarpSize;

// ---------------------------------------------------------------------------------------------
// KeyGram: grid x = e tile, y = d tile, z = kv head. Thread (tx, ty) sums gram[d0 + ty + 8i,
// e0 + tx] over the slots, 32 at a time staged in shared memory as f32.
template <typename T>
__global__ void __launch_bounds__(kGramThreads) KeyGramKernel(KeyGramArgs args) {
  __shared__ float rows_d[kGramTile][kGramTile + 1];  // [slot][d]
  __shared__ float rows_e[kGramTile][kGramTile + 1];  // [slot][e]
  constexpr int kRowStep = kGramThreads / kGramTile;
  const int tx = threadIdx.x % kGramTile;
  const int ty = threadIdx.x / kGramTile;
  const int64_t d_count = args.head_dim;
  const int64_t d0 = int64_t{blockIdx.y} * kGramTile;
  const int64_t e0 = int64_t{blockIdx.x} * kGramTile;
  const T* head =
      static_cast<const T*>(args.k) + (blockIdx.z * args.capacity + args.first_slot) * d_count;
  float acc[kGramRowsPerThread] = {};
  for (int64_t s0 = 0; s0 < args.count; s0 += kGramTile) {
    for (int i = threadIdx.x; i < kGramTile * kGramTile; i += kGramThreads) {
      const int s = i / kGramTile;
      const int c = i % kGramTile;
      const bool slot = s0 + s < args.count;
      const T* row = head + (s0 + s) * d_count;
      rows_d[s][c] = slot && d0 + c < d_count ? ToFloat(row[d0 + c]) : 0.0f;
      rows_e[s][c] = slot && e0 + c < d_count ? ToFloat(row[e0 + c]) : 0.0f;
    }
    __syncthreads();
#pragma unroll 8
    for (int s = 0; s < kGramTile; ++s) {  // padded slots add 0·0
      const float e = rows_e[s][tx];
#pragma unroll
      for (int i = 0; i < kGramRowsPerThread; ++i) {
        acc[i] = fmaf(rows_d[s][ty + i * kRowStep], e, acc[i]);
      }
    }
    __syncthreads();
  }
  float* gram = args.gram + blockIdx.z * d_count * d_count;
#pragma unroll
  for (int i = 0; i < kGramRowsPerThread; ++i) {
    const int64_t d = d0 + ty + i * kRowStep;
    if (d < d_count && e0 + tx < d_count) gram[d * d_count + e0 + tx] = acc[i];
  }
}

// ---------------------------------------------------------------------------------------------
// ProjectKeys: grid x = groups of kProjectWarps·kProjectKeysPerWarp keys, y = kv head. Lane l
// holds the coordinates r = pass·256 + l + 32i of the warp's keys; ranks over 256 compute the
// coordinates twice (once for the scale, once for the codes).
template <typename T>
__device__ __forceinline__ void ProjectPass(const ProjectKeysArgs& args, const T* const* keys,
                                            int key_count, const float* basis, int pass,
                                            float (&c)[kProjectKeysPerWarp][kProjectPerLane]) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t rank = args.rank;
#pragma unroll
  for (int k = 0; k < kProjectKeysPerWarp; ++k) {
#pragma unroll
    for (int i = 0; i < kProjectPerLane; ++i) c[k][i] = 0.0f;
  }
  for (int64_t d = 0; d < args.head_dim; ++d) {
    float kd[kProjectKeysPerWarp];
#pragma unroll
    for (int k = 0; k < kProjectKeysPerWarp; ++k)
      kd[k] = k < key_count ? ToFloat(keys[k][d]) : 0.0f;
#pragma unroll
    for (int i = 0; i < kProjectPerLane; ++i) {
      const int64_t r = int64_t{pass} * kProjectRanksPerPass + lane + i * kWarpSize;
      const float b = r < rank ? basis[d * rank + r] : 0.0f;
#pragma unroll
      for (int k = 0; k < kProjectKeysPerWarp; ++k) c[k][i] = fmaf(kd[k], b, c[k][i]);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kProjectWarps* kWarpSize)
    ProjectKeysKernel(ProjectKeysArgs args) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t first =
      (int64_t{blockIdx.x} * kProjectWarps + warp) * kProjectKeysPerWarp;  // key index
  if (first >= args.count) return;
  const int key_count = static_cast<int>(
      first + kProjectKeysPerWarp <= args.count ? kProjectKeysPerWarp : args.count - first);
  const int64_t g = blockIdx.y;
  const T* keys[kProjectKeysPerWarp];
#pragma unroll
  for (int k = 0; k < kProjectKeysPerWarp; ++k) {
    keys[k] = static_cast<const T*>(args.k) +
              (g * args.capacity + args.first_slot + first + k) * args.head_dim;
  }
  const float* basis = args.basis + g * args.head_dim * args.rank;
  const int passes =
      static_cast<int>((args.rank + kProjectRanksPerPass - 1) / kProjectRanksPerPass);

  float c[kProjectKeysPerWarp][kProjectPerLane];
  float amax[kProjectKeysPerWarp] = {};
  for (int pass = 0; pass < passes; ++pass) {
    ProjectPass<T>(args, keys, key_count, basis, pass, c);
#pragma unroll
    for (int k = 0; k < kProjectKeysPerWarp; ++k) {
#pragma unroll
      for (int i = 0; i < kProjectPerLane; ++i) amax[k] = fmaxf(amax[k], fabsf(c[k][i]));
    }
  }
  float scale[kProjectKeysPerWarp];
#pragma unroll
  for (int k = 0; k < kProjectKeysPerWarp; ++k) scale[k] = WarpMax(amax[k]) / 127.0f;
  // The last pass's coordinates are still in c; earlier passes are computed again.
  for (int pass = passes - 1; pass >= 0; --pass) {
    if (pass != passes - 1) ProjectPass<T>(args, keys, key_count, basis, pass, c);
#pragma unroll
    for (int k = 0; k < kProjectKeysPerWarp; ++k) {
      if (k >= key_count) break;
      const bool usable = scale[k] > 0.0f && scale[k] <= FLT_MAX;
      int8_t* dst = args.coords + (g * args.max_tokens + args.first_token + first + k) * args.rank;
#pragma unroll
      for (int i = 0; i < kProjectPerLane; ++i) {
        const int64_t r = int64_t{pass} * kProjectRanksPerPass + lane + i * kWarpSize;
        if (r >= args.rank) break;
        const float v = usable ? fminf(fmaxf(rintf(c[k][i] / scale[k]), -127.0f), 127.0f) : 0.0f;
        dst[r] = static_cast<int8_t>(v);
      }
    }
  }
  if (lane < key_count) {
    float s = scale[0];
#pragma unroll
    for (int k = 1; k < kProjectKeysPerWarp; ++k) s = lane == k ? scale[k] : s;
    args.scales[g * args.max_tokens + args.first_token + first + lane] = s;
  }
}


}  // namespace

cudaError_t LaunchKeyGram(const KeyGramArgs& args, cudaStream_t stream) {
  if (args.num_kv_heads <= 0 || args.head_dim <= 0 || args.count <= 0) return cudaSuccess;
  const unsigned tiles = static_cast<unsigned>((args.head_dim + kGramTile - 1) / kGramTile);
  const dim3 blocks(tiles, tiles, static_cast<unsigned>(args.num_kv_heads));
  switch (args.dtype) {
    case DType::kF32:
      KeyGramKernel<float><<<blocks, kGramThreads, 0, stream>>>(args);
      break;
    case DType::kBF16:
      KeyGramKernel<__nv_bfloat16><<<blocks, kGramThreads, 0, stream>>>(args);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchProjectKeys(const ProjectKeysArgs& args, cudaStream_t stream) {
  if (args.num_kv_heads <= 0 || args.count <= 0 || args.rank <= 0) return cudaSuccess;
  constexpr int64_t kKeysPerBlock = kProjectWarps * kProjectKeysPerWarp;
  const dim3 blocks(static_cast<unsigned>((args.count + kKeysPerBlock - 1) / kKeysPerBlock),
                    static_cast<unsigned>(args.num_kv_heads));
  switch (args.dtype) {
    case DType::kF32:
      ProjectKeysKernel<float><<<blocks, kProjectWarps * kWarpSize, 0, stream>>>(args);
      break;
    case DType::kBF16:
      ProjectKeysKernel<__nv_bfloat16><<<blocks, kProjectWarps * kWarpSize, 0, stream>>>(args);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace tandem::gpu_worker::cuda_backend
