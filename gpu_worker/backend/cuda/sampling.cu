#include <climits>
#include <cub/device/device_radix_sort.cuh>

#include "device_utils.cuh"
#include "sampling.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

// The sampling kernels are single-block: one row of at most a few 100k logits.
constexpr int kSampleThreads = 1024;
constexpr int kLogProbThreads = 1024;
constexpr size_t kAlign = 256;

size_t AlignUp(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

struct SampleLayout {
  size_t probs = 0;         // float [vocab], id order
  size_t ids = 0;           // int32 [vocab]: 0, 1, ...
  size_t sorted_probs = 0;  // float [vocab], descending
  size_t sorted_ids = 0;    // int32 [vocab]
  size_t keep = 0;          // uint8 [vocab]
  size_t sort_temp = 0;     // cub temporary storage
  size_t sort_temp_bytes = 0;
  size_t total = 0;
};

cudaError_t MakeLayout(int64_t vocab, SampleLayout* layout) {
  const int n = static_cast<int>(vocab);
  size_t sort_bytes = 0;
  const cudaError_t error = cub::DeviceRadixSort::SortPairsDescending(
      nullptr, sort_bytes, static_cast<const float*>(nullptr), static_cast<float*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), n);
  if (error != cudaSuccess) return error;
  const size_t floats = AlignUp(sizeof(float) * vocab);
  size_t offset = 0;
  layout->probs = offset;
  offset += floats;
  layout->ids = offset;
  offset += floats;
  layout->sorted_probs = offset;
  offset += floats;
  layout->sorted_ids = offset;
  offset += floats;
  layout->keep = offset;
  offset += AlignUp(static_cast<size_t>(vocab));
  layout->sort_temp = offset;
  layout->sort_temp_bytes = sort_bytes;
  layout->total = offset + AlignUp(sort_bytes);
  return cudaSuccess;
}

// Exclusive prefix sum of one double per thread over the block (blockDim.x <= 1024, a multiple
// of 32); *total gets the block's sum. `scratch`: 32 doubles of shared memory.
__device__ double BlockExclusiveScan(double v, double* scratch, double* total) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  double inclusive = v;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset <<= 1) {
    const double up = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  __syncthreads();
  if (lane == kWarpSize - 1) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    double w = lane < num_warps ? scratch[lane] : 0.0;
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset <<= 1) {
      const double up = __shfl_up_sync(kFullMask, w, offset);
      if (lane >= offset) w += up;
    }
    scratch[lane] = w;
  }
  __syncthreads();
  *total = scratch[num_warps - 1];
  return (warp > 0 ? scratch[warp - 1] : 0.0) + inclusive - v;
}

// The contiguous range [begin, end) of n elements handled by this thread, in thread order.
__device__ __forceinline__ void ThreadRange(int64_t n, int64_t* begin, int64_t* end) {
  const int64_t chunk = (n + blockDim.x - 1) / blockDim.x;
  *begin = min(n, threadIdx.x * chunk);
  *end = min(n, *begin + chunk);
}

// Argmax with the lowest index among equal maxima; NaN never wins; all NaN gives 0.
__global__ void ArgmaxKernel(const float* logits, int64_t vocab, int32_t* result) {
  __shared__ float best_values[kSampleThreads / kWarpSize];
  __shared__ int best_ids[kSampleThreads / kWarpSize];
  float best = -INFINITY;
  int best_id = INT_MAX;  // none yet
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = logits[i];
    if (!isnan(v) && (best_id == INT_MAX || v > best)) {
      best = v;
      best_id = static_cast<int>(i);
    }
  }
  auto better = [](float v, int id, float than_v, int than_id) {
    if (id == INT_MAX) return false;
    if (than_id == INT_MAX) return true;
    return v > than_v || (v == than_v && id < than_id);
  };
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    const float v = __shfl_xor_sync(kFullMask, best, offset);
    const int id = __shfl_xor_sync(kFullMask, best_id, offset);
    if (better(v, id, best, best_id)) {
      best = v;
      best_id = id;
    }
  }
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  if (lane == 0) {
    best_values[warp] = best;
    best_ids[warp] = best_id;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x / kWarpSize); ++w) {
      if (better(best_values[w], best_ids[w], best, best_id)) {
        best = best_values[w];
        best_id = best_ids[w];
      }
    }
    *result = best_id == INT_MAX ? 0 : best_id;
  }
}

// probs[i] = softmax(logits / temperature)[i], computed as exp((l_i - max) / temperature) / Σ
// like the cpu backend; NaN logits get 0; 0 everywhere if no logit is finite.
__global__ void SoftmaxKernel(const float* logits, int64_t vocab, float temperature, float* probs,
                              int32_t* ids) {
  __shared__ float scratch[kWarpSize];
  float max_logit = -INFINITY;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) max_logit = fmaxf(max_logit, logits[i]);
  max_logit = BlockMax(max_logit, scratch);
  const bool finite = isfinite(max_logit);
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float l = logits[i];
    if (finite && !isnan(l)) sum += expf((l - max_logit) / temperature);
  }
  sum = BlockSum(sum, scratch);
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float l = logits[i];
    probs[i] =
        (finite && !isnan(l) && sum > 0.0f) ? expf((l - max_logit) / temperature) / sum : 0.0f;
    ids[i] = static_cast<int32_t>(i);
  }
}

// keep[id] = 1 for the first n entries of the descending order, 0 for the rest: n = top_k (all
// when top_k <= 0), then the shortest prefix of those whose mass reaches top_p · (their mass),
// n >= 1 (the cpu backend's reading: top_p applies to the top-k set renormalised).
__global__ void KeepTopKTopPKernel(const float* sorted_probs, const int32_t* sorted_ids,
                                   int64_t vocab, int32_t top_k, float top_p, uint8_t* keep) {
  __shared__ double scratch[kWarpSize];
  __shared__ int64_t first_reaching;
  const int64_t k = (top_k > 0 && top_k < vocab) ? top_k : vocab;
  int64_t n = k;
  if (top_p < 1.0f) {
    if (threadIdx.x == 0) first_reaching = LLONG_MAX;
    int64_t begin;
    int64_t end;
    ThreadRange(k, &begin, &end);
    double local = 0.0;
    for (int64_t r = begin; r < end; ++r) local += sorted_probs[r];
    double top_k_mass;
    double cum = BlockExclusiveScan(local, scratch, &top_k_mass);  // also orders the init above
    const double target = static_cast<double>(top_p) * top_k_mass;
    for (int64_t r = begin; r < end; ++r) {
      cum += sorted_probs[r];
      if (cum >= target) {
        atomicMin(reinterpret_cast<unsigned long long*>(&first_reaching),
                  static_cast<unsigned long long>(r));
        break;
      }
    }
    __syncthreads();
    if (first_reaching != LLONG_MAX) n = first_reaching + 1;
  }
  n = max(n, int64_t{1});
  for (int64_t r = threadIdx.x; r < vocab; r += blockDim.x) keep[sorted_ids[r]] = r < n ? 1 : 0;
}

// The first id (ascending) at which Σ_{j <= id, kept} probs[j] > uniform · Σ_{kept} probs; if
// rounding leaves none, the last kept id with nonzero probability; if no id has mass, *result
// is left as it was (the argmax). keep == nullptr keeps every id.
__global__ void InverseCdfKernel(const float* probs, const uint8_t* keep, int64_t vocab,
                                 float uniform, int32_t* result) {
  __shared__ double scratch[kWarpSize];
  __shared__ int chosen;
  __shared__ int last_kept;
  if (threadIdx.x == 0) {
    chosen = INT_MAX;
    last_kept = -1;
  }
  int64_t begin;
  int64_t end;
  ThreadRange(vocab, &begin, &end);
  double local = 0.0;
  int local_last = -1;
  for (int64_t i = begin; i < end; ++i) {
    const float w = (keep == nullptr || keep[i] != 0) ? probs[i] : 0.0f;
    if (w > 0.0f) {
      local += w;
      local_last = static_cast<int>(i);
    }
  }
  double total;
  double cum = BlockExclusiveScan(local, scratch, &total);  // also orders the init above
  const double target = static_cast<double>(uniform) * total;
  for (int64_t i = begin; i < end; ++i) {
    const float w = (keep == nullptr || keep[i] != 0) ? probs[i] : 0.0f;
    if (w > 0.0f) {
      cum += w;
      if (cum > target) {
        atomicMin(&chosen, static_cast<int>(i));
        break;
      }
    }
  }
  if (local_last >= 0) atomicMax(&last_kept, local_last);
  __syncthreads();
  if (threadIdx.x == 0) {
    if (chosen != INT_MAX) {
      *result = chosen;
    } else if (last_kept >= 0) {
      *result = last_kept;
    }  // else no mass at all (no finite logit): *result keeps the argmax written before
  }
}

// grid: [num_tokens]; a stable log-softmax of each row, read at the target.
__global__ void TokenLogProbsKernel(TokenLogProbsArgs args) {
  __shared__ float scratch[kWarpSize];
  const int64_t t = blockIdx.x;
  const float* x = args.logits + t * args.vocab;
  float max_x = -INFINITY;
  for (int64_t i = threadIdx.x; i < args.vocab; i += blockDim.x) max_x = fmaxf(max_x, x[i]);
  max_x = BlockMax(max_x, scratch);
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < args.vocab; i += blockDim.x) sum += expf(x[i] - max_x);
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) {
    const int32_t target = args.targets[t];
    args.out[t] = (target >= 0 && target < args.vocab) ? x[target] - max_x - logf(sum) : NAN;
  }
}

}  // namespace

cudaError_t SampleWorkspaceBytes(int64_t vocab, size_t* bytes) {
  if (vocab <= 0 || vocab > INT_MAX) return cudaErrorInvalidValue;
  SampleLayout layout;
  const cudaError_t error = MakeLayout(vocab, &layout);
  if (error != cudaSuccess) return error;
  *bytes = layout.total;
  return cudaSuccess;
}

cudaError_t LaunchSample(const SampleArgs& args, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream) {
  if (args.vocab <= 0 || args.vocab > INT_MAX) return cudaErrorInvalidValue;
  // The argmax is the answer for temperature <= 0, and the fallback when no logit is finite
  // (a +inf logit takes all the mass: the lowest such id, as on the cpu backend).
  ArgmaxKernel<<<1, kSampleThreads, 0, stream>>>(args.logits, args.vocab, args.result);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess || args.temperature <= 0.0f) return error;
  SampleLayout layout;
  error = MakeLayout(args.vocab, &layout);
  if (error != cudaSuccess) return error;
  if (workspace == nullptr || workspace_bytes < layout.total) return cudaErrorInvalidValue;
  char* base = static_cast<char*>(workspace);
  float* probs = reinterpret_cast<float*>(base + layout.probs);
  int32_t* ids = reinterpret_cast<int32_t*>(base + layout.ids);
  float* sorted_probs = reinterpret_cast<float*>(base + layout.sorted_probs);
  int32_t* sorted_ids = reinterpret_cast<int32_t*>(base + layout.sorted_ids);
  uint8_t* keep = reinterpret_cast<uint8_t*>(base + layout.keep);

  SoftmaxKernel<<<1, kSampleThreads, 0, stream>>>(args.logits, args.vocab, args.temperature, probs,
                                                  ids);
  error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  const bool filter = (args.top_k > 0 && args.top_k < args.vocab) || args.top_p < 1.0f;
  if (filter) {
    // Radix sort is stable: equal probabilities stay in ascending id order.
    size_t temp_bytes = layout.sort_temp_bytes;
    error = cub::DeviceRadixSort::SortPairsDescending(
        base + layout.sort_temp, temp_bytes, probs, sorted_probs, ids, sorted_ids,
        static_cast<int>(args.vocab), 0, static_cast<int>(sizeof(float) * 8), stream);
    if (error != cudaSuccess) return error;
    KeepTopKTopPKernel<<<1, kSampleThreads, 0, stream>>>(sorted_probs, sorted_ids, args.vocab,
                                                         args.top_k, args.top_p, keep);
    error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  InverseCdfKernel<<<1, kSampleThreads, 0, stream>>>(probs, filter ? keep : nullptr, args.vocab,
                                                     args.uniform, args.result);
  return cudaGetLastError();
}

cudaError_t LaunchTokenLogProbs(const TokenLogProbsArgs& args, cudaStream_t stream) {
  if (args.num_tokens <= 0 || args.vocab <= 0) return cudaSuccess;
  const int threads = RowBlockThreads(args.vocab, kLogProbThreads);
  TokenLogProbsKernel<<<static_cast<unsigned>(args.num_tokens), threads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace tandem::gpu_worker::cuda_backend
