// Tensor-core window attention (window_attention_mma.cuh): mma.sync m16n8k16 bf16 tiles with
// f32 accumulation, the f32 operands split into bf16 hi + lo.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>

#include "attention_common.cuh"
#include "device_utils.cuh"
#include "mma_utils.cuh"
#include "window_attention_mma.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kRows = static_cast<int>(kMmaRowsPerBlock);  // 16 per warp
constexpr int kTile = static_cast<int>(kMmaSlotTile);
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// K/V tiles in flight per block: two loading while one is computed (3 x 33 KB at head_dim 128,
// so two blocks fit a multiprocessor).
constexpr int kStages = 3;

// Shared memory of one pipeline stage: K and V tiles [kTile][kD] bf16 (swizzled 16-byte
// chunks), then the tile's slot positions [kTile] (-1 = empty or past the split).
template <int kD>
struct StageLayout {
  static constexpr int kChunks = kD / 8;  // 16-byte chunks per row
  static constexpr size_t kTileBytes = size_t{kTile} * kD * sizeof(__nv_bfloat16);
  static constexpr size_t kBytes = 2 * kTileBytes + kTile * sizeof(int);
  static constexpr size_t kSmemBytes = kStages * kBytes;
};

// Per 64-slot tile j (slots [64j, 64j + 64)): tile_min[j] = the smallest slot_pos >= 0 in it
// (INT32_MAX when there is none), tile_max[j] = the largest, or INT32_MAX when the tile has an
// empty slot or slots past num_slots (then every score needs the mask). One warp per tile.
__global__ void TileBoundsKernel(const int32_t* slot_pos, int64_t num_slots, int32_t* tile_min,
                                 int32_t* tile_max) {
  const int64_t tiles = (num_slots + kTile - 1) / kTile;
  const int64_t tile = blockIdx.x * int64_t{blockDim.x / kWarpSize} + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (tile >= tiles) return;
  int lo = INT_MAX, hi = 0;
  for (int i = lane; i < kTile; i += kWarpSize) {
    const int64_t s = tile * kTile + i;
    const int p = s < num_slots ? slot_pos[s] : -1;
    if (p >= 0) {
      lo = min(lo, p);
      hi = max(hi, p);
    } else {
      hi = INT_MAX;
    }
  }
  lo = __reduce_min_sync(kFullMask, lo);
  hi = __reduce_max_sync(kFullMask, hi);
  if (lane == 0) {
    tile_min[tile] = lo;
    tile_max[tile] = hi;
  }
}

// grid [row_tiles, num_kv_heads, splits], kThreads threads. Warp w owns query rows
// row0 + 16w .. + 15 of kv head g; lane holds the mma fragment rows lane/4 and lane/4 + 8.
// Per 64-slot tile: S = Q·Kᵀ (Q hi and lo fragments in registers, K through ldmatrix), the
// position mask, the online softmax on S's accumulators, then O += P·V (P hi and lo built from
// S's registers, V through ldmatrix.trans). The next tile's cp.async runs during this one.
template <int kD, bool kExact>
__global__ void __launch_bounds__(kThreads)
    MmaAttentionKernel(WindowAttentionArgs a, int64_t slots_per_split, const int32_t* tile_min,
                       const int32_t* tile_max, float* part_o, float* part_lse,
                       float* scores) {
  using Stage = StageLayout<kD>;
  constexpr int kKSteps = kD / 16;       // k-steps of Q·Kᵀ
  constexpr int kDimTiles = kD / 8;      // n-tiles of O
  constexpr int kKeyTiles = kTile / 8;   // n-tiles of S
  constexpr int kLoadChunks = Stage::kChunks / 2;  // chunks per thread per K (or V) tile
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int red_max[kWarps], red_min[kWarps], red_first[kWarps], red_last[kWarps];
  AllowDependentLaunch();  // the split combine may be scheduled now (it waits for us)

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t g = blockIdx.y;
  const int64_t row0 = (gridDim.x - 1 - blockIdx.x) * int64_t{kRows};  // latest rows first
  const int64_t split = blockIdx.z;
  const int64_t group = a.num_q_heads / a.num_kv_heads;
  const int64_t rows = a.num_tokens * group;
  const int head_dim = static_cast<int>(a.head_dim);

  const int64_t row_a = row0 + warp * 16 + lane / 4;
  const int64_t row_b = row_a + 8;
  const int qpos_a = row_a < rows ? a.q_pos[row_a / group] : -1;  // -1: sees nothing
  const int qpos_b = row_b < rows ? a.q_pos[row_b / group] : -1;

  // The tiles of this split that hold a position some row of the block can see.
  const int64_t s_begin = split * slots_per_split;
  const int64_t s_end = min(a.num_slots, s_begin + slots_per_split);
  const int64_t tile_begin = s_begin / kTile;
  const int tiles = static_cast<int>((s_end - s_begin + kTile - 1) / kTile);
  int max_qpos = __reduce_max_sync(kFullMask, max(qpos_a, qpos_b));
  int min_qpos = __reduce_min_sync(kFullMask, min(qpos_a, qpos_b));  // -1 with padding rows
  if (lane == 0) {
    red_max[warp] = max_qpos;
    red_min[warp] = min_qpos;
  }
  __syncthreads();
  max_qpos = max(max(red_max[0], red_max[1]), max(red_max[2], red_max[3]));
  min_qpos = min(min(red_min[0], red_min[1]), min(red_min[2], red_min[3]));
  int first = INT_MAX, last = -1;
  for (int j = threadIdx.x; j < tiles; j += kThreads) {
    if (tile_min[tile_begin + j] <= max_qpos) {
      first = min(first, j);
      last = max(last, j);
    }
  }
  first = __reduce_min_sync(kFullMask, first);
  last = __reduce_max_sync(kFullMask, last);
  if (lane == 0) {
    red_first[warp] = first;
    red_last[warp] = last;
  }
  __syncthreads();
  first = min(min(red_first[0], red_first[1]), min(red_first[2], red_first[3]));
  last = max(max(red_last[0], red_last[1]), max(red_last[2], red_last[3]));

  // Q fragments (A operand, row-major 16x16 per k-step): registers 0/1 hold rows a/b at columns
  // 2(lane%4) + {0, 1}, registers 2/3 the same rows 8 columns on. Zero past head_dim and for
  // rows past T·G.
  uint32_t q_hi[kKSteps][4], q_lo[kKSteps][4];
  {
    const float* qa = row_a < rows ? a.q + (row_a / group) * a.q_row_stride +
                                         (g * group + row_a % group) * head_dim
                                   : nullptr;
    const float* qb = row_b < rows ? a.q + (row_b / group) * a.q_row_stride +
                                         (g * group + row_b % group) * head_dim
                                   : nullptr;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = kk * 16 + half * 8 + 2 * (lane % 4);
        const bool in = col < head_dim;
        const float xa0 = (qa != nullptr && in) ? qa[col] : 0.0f;
        const float xa1 = (qa != nullptr && in) ? qa[col + 1] : 0.0f;
        const float xb0 = (qb != nullptr && in) ? qb[col] : 0.0f;
        const float xb1 = (qb != nullptr && in) ? qb[col + 1] : 0.0f;
        SplitBf16(xa0, xa1, q_hi[kk][2 * half], q_lo[kk][2 * half]);
        SplitBf16(xb0, xb1, q_hi[kk][2 * half + 1], q_lo[kk][2 * half + 1]);
      }
    }
  }

  float o[kDimTiles][4];
#pragma unroll
  for (int nd = 0; nd < kDimTiles; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;
  float m_a = -INFINITY, m_b = -INFINITY;  // running max of score·log2(e)
  float l_a = 0.0f, l_b = 0.0f;            // this lane's share of Σ 2^(score·log2e - m)
  const float scale_log2 = a.scale * kLog2e;

  const __nv_bfloat16* k_head =
      static_cast<const __nv_bfloat16*>(a.k_cache) + g * a.capacity * a.head_dim;
  const __nv_bfloat16* v_head =
      static_cast<const __nv_bfloat16*>(a.v_cache) + g * a.capacity * a.head_dim;
  // Loader: thread i copies chunks (i % 2) + 2c of tile row i / 2 (each pair of threads reads
  // 32 contiguous bytes per instruction) and fetches that row's slot position.
  const int ld_row = threadIdx.x / 2;
  const int ld_chunk0 = threadIdx.x % 2;
  const int valid_chunks = head_dim / 8;
  auto stage_ptr = [&](int stage) { return smem + stage * Stage::kBytes; };
  // Queues tile j's copies into its stage and returns the slot position of this thread's row
  // (-1: empty or past the split). Past `last` it only commits an empty group, so that every
  // iteration's wait_group counts the same groups.
  auto issue = [&](int j) -> int {
    if (j > last) {
      CpAsyncCommit();
      return -1;
    }
    const int stage = (j - first) % kStages;
    const int64_t s = (tile_begin + j) * kTile + ld_row;
    const bool in = s < s_end;
    const int64_t row = in ? s : s_begin;  // a readable row for the zero-fill copies
    __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(stage_ptr(stage));
    __nv_bfloat16* vs = ks + kTile * kD;
#pragma unroll
    for (int i = 0; i < kLoadChunks; ++i) {
      const int c = ld_chunk0 + 2 * i;
      const bool valid = in && c < valid_chunks;
      const int64_t offset = row * a.head_dim + (valid ? c * 8 : 0);
      CpAsync16(SmemAddr(ks + SwizzledOffset<kD>(ld_row, c)), k_head + offset, valid);
      CpAsync16(SmemAddr(vs + SwizzledOffset<kD>(ld_row, c)), v_head + offset, valid);
    }
    CpAsyncCommit();
    return in ? a.slot_pos[s] : -1;
  };

  if (first <= last) {
    int pos_next = issue(first);      // this thread's slot position in tile j + 1 ...
    int pos_after = issue(first + 1);  // ... and in tile j + 2
    for (int j = first; j <= last; ++j) {
      const int stage = (j - first) % kStages;
      __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(stage_ptr(stage));
      __nv_bfloat16* vs = ks + kTile * kD;
      int* spos = reinterpret_cast<int*>(vs + kTile * kD);
      const int pos = pos_next;
      CpAsyncWait<kStages - 2>();  // tile j has landed (this thread's copies)
      // NOTE: an empty slot's V row may be unwritten memory (NaN); its weight is 0, but
      // 0·NaN = NaN in the mma, so the row is zeroed (by the threads that copied it).
      if (pos < 0) {
#pragma unroll
        for (int i = 0; i < kLoadChunks; ++i) {
          *reinterpret_cast<uint4*>(vs + SwizzledOffset<kD>(ld_row, ld_chunk0 + 2 * i)) =
              make_uint4(0, 0, 0, 0);
        }
      }
      if (ld_chunk0 == 0) spos[ld_row] = pos;
      __syncthreads();  // tile j is visible to every warp; tile j - 1's stage is free
      pos_next = pos_after;
      pos_after = issue(j + kStages - 1);
      // Every slot of the tile holds a position every row of the block sees: no mask.
      const bool unmasked = tile_max[tile_begin + j] <= min_qpos;  // block-uniform

      // S = Q·Kᵀ: B fragments of 8 keys x 32 dims per ldmatrix.x4 (chunks 2kk .. 2kk + 3).
      float s[kKeyTiles][4];
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kKSteps; kk += 2) {
        if (kk * 16 >= head_dim) break;  // zero padding (warp-uniform)
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
          uint32_t b[4];
          LdMatrixX4(SmemAddr(ks + SwizzledOffset<kD>(n * 8 + (lane & 7), kk * 2 + (lane >> 3))),
                     b);
          Mma(s[n], q_hi[kk], b[0], b[1]);
          if constexpr (kExact) Mma(s[n], q_lo[kk], b[0], b[1]);
          Mma(s[n], q_hi[kk + 1], b[2], b[3]);
          if constexpr (kExact) Mma(s[n], q_lo[kk + 1], b[2], b[3]);
        }
      }

      // Mask by position (accumulator layout: s[n][0..1] row a, s[n][2..3] row b, keys
      // 8n + 2(lane%4) + {0, 1}), then the online softmax in log2 units.
      if (scores != nullptr) {  // natural-unit scores for the MAW update
        const int64_t tile_base = (tile_begin + j) * kTile;
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
          const int col = n * 8 + 2 * (lane & 3);
          const int2 p = *reinterpret_cast<const int2*>(spos + col);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int64_t row = e < 2 ? row_a : row_b;
            const int64_t slot = tile_base + col + (e & 1);
            const int sp = (e & 1) ? p.y : p.x;
            const int qp = e < 2 ? qpos_a : qpos_b;
            if (row < rows && slot < s_end) {
              scores[(g * rows + row) * a.num_slots + slot] =
                  (sp >= 0 && sp <= qp) ? s[n][e] * a.scale : -INFINITY;
            }
          }
        }
      }
      float mx_a = -INFINITY, mx_b = -INFINITY;
      if (unmasked) {
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
          for (int i = 0; i < 4; ++i) s[n][i] *= scale_log2;
        }
      } else {
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
          const int2 p = *reinterpret_cast<const int2*>(spos + n * 8 + 2 * (lane & 3));
          s[n][0] = (p.x >= 0 && p.x <= qpos_a) ? s[n][0] * scale_log2 : -INFINITY;
          s[n][1] = (p.y >= 0 && p.y <= qpos_a) ? s[n][1] * scale_log2 : -INFINITY;
          s[n][2] = (p.x >= 0 && p.x <= qpos_b) ? s[n][2] * scale_log2 : -INFINITY;
          s[n][3] = (p.y >= 0 && p.y <= qpos_b) ? s[n][3] * scale_log2 : -INFINITY;
        }
      }
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
        mx_a = fmaxf(mx_a, fmaxf(s[n][0], s[n][1]));
        mx_b = fmaxf(mx_b, fmaxf(s[n][2], s[n][3]));
      }
      const auto [base_a, base_b, corr_a, corr_b] = OnlineSoftmaxStep(mx_a, mx_b, &m_a, &m_b);
      l_a *= corr_a;
      l_b *= corr_b;
      if (__any_sync(kFullMask, corr_a != 1.0f || corr_b != 1.0f)) {  // a row's max moved
#pragma unroll
        for (int nd = 0; nd < kDimTiles; ++nd) {
          o[nd][0] *= corr_a;
          o[nd][1] *= corr_a;
          o[nd][2] *= corr_b;
          o[nd][3] *= corr_b;
        }
      }
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
        s[n][0] = Exp2(s[n][0] - base_a);
        s[n][1] = Exp2(s[n][1] - base_a);
        s[n][2] = Exp2(s[n][2] - base_b);
        s[n][3] = Exp2(s[n][3] - base_b);
        l_a += s[n][0] + s[n][1];
        l_b += s[n][2] + s[n][3];
      }

      // O += P·V: P's A fragments for keys 16kk .. 16kk + 15 are S's n-tiles 2kk and 2kk + 1;
      // V's B fragments for two 8-dim n-tiles per ldmatrix.x4.trans.
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        uint32_t p_hi[4], p_lo[4];
        SplitBf16(s[2 * kk][0], s[2 * kk][1], p_hi[0], p_lo[0]);
        SplitBf16(s[2 * kk][2], s[2 * kk][3], p_hi[1], p_lo[1]);
        SplitBf16(s[2 * kk + 1][0], s[2 * kk + 1][1], p_hi[2], p_lo[2]);
        SplitBf16(s[2 * kk + 1][2], s[2 * kk + 1][3], p_hi[3], p_lo[3]);
        const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int nd = 0; nd < kDimTiles; nd += 2) {
          if (nd * 8 >= head_dim) break;  // zero padding (warp-uniform)
          uint32_t b[4];
          LdMatrixX4Trans(SmemAddr(vs + SwizzledOffset<kD>(key, nd + (lane >> 4))), b);
          Mma(o[nd], p_hi, b[0], b[1]);
          if constexpr (kExact) Mma(o[nd], p_lo, b[0], b[1]);
          Mma(o[nd + 1], p_hi, b[2], b[3]);
          if constexpr (kExact) Mma(o[nd + 1], p_lo, b[2], b[3]);
        }
      }
    }
  }

  // Epilogue: l summed over the 4 lanes of a row; o = O / l, lse = m·ln2 + log(l).
  l_a += __shfl_xor_sync(kFullMask, l_a, 1);
  l_a += __shfl_xor_sync(kFullMask, l_a, 2);
  l_b += __shfl_xor_sync(kFullMask, l_b, 1);
  l_b += __shfl_xor_sync(kFullMask, l_b, 2);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = half == 0 ? row_a : row_b;
    if (row >= rows) continue;
    const float m = half == 0 ? m_a : m_b;
    const float l = half == 0 ? l_a : l_b;
    const bool empty = m == -INFINITY;
    const float inv = empty ? 0.0f : 1.0f / l;
    const float lse = empty ? -INFINITY : m * kLn2 + logf(l);
    const int64_t out_row = (row / group) * a.num_q_heads + g * group + row % group;
    float* dst_o = a.o;
    float* dst_lse = a.lse;
    int64_t dst_row = out_row;
    if (part_o != nullptr) {
      dst_o = part_o;
      dst_lse = part_lse;
      dst_row = split * a.num_tokens * a.num_q_heads + out_row;
    }
#pragma unroll
    for (int nd = 0; nd < kDimTiles; ++nd) {
      const int col = nd * 8 + 2 * (lane & 3);
      if (col < head_dim) {
        dst_o[dst_row * a.head_dim + col] = o[nd][2 * half] * inv;
        dst_o[dst_row * a.head_dim + col + 1] = o[nd][2 * half + 1] * inv;
      }
    }
    if ((lane & 3) == 0) dst_lse[dst_row] = lse;
  }
}

template <int kD, bool kExact>
cudaError_t PrepareKernel() {
  return cudaFuncSetAttribute(MmaAttentionKernel<kD, kExact>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(StageLayout<kD>::kSmemBytes));
}

template <int kD, bool kExact>
cudaError_t Occupancy(int* blocks) {
  const cudaError_t error = PrepareKernel<kD, kExact>();
  if (error != cudaSuccess) return error;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, MmaAttentionKernel<kD, kExact>,
                                                       kThreads, StageLayout<kD>::kSmemBytes);
}

template <int kD, bool kExact>
cudaError_t Launch(const WindowAttentionArgs& a, dim3 grid, int64_t slots_per_split,
                   const int32_t* tile_min, float* part_o, float* part_lse, float* scores,
                   cudaStream_t stream) {
  const cudaError_t error = PrepareKernel<kD, kExact>();
  if (error != cudaSuccess) return error;
  MmaAttentionKernel<kD, kExact><<<grid, kThreads, StageLayout<kD>::kSmemBytes, stream>>>(
      a, slots_per_split, tile_min, tile_min + (a.num_slots + kTile - 1) / kTile, part_o,
      part_lse, scores);
  return cudaGetLastError();
}

}  // namespace

bool MmaAttentionSupports(const WindowAttentionArgs& a) {
  return a.cache_dtype == DType::kBF16 && a.head_dim <= 128;
}

size_t MmaTileSummaryBytes(int64_t num_slots) {
  return 2 * static_cast<size_t>((num_slots + kTile - 1) / kTile) * sizeof(int32_t);
}

cudaError_t MmaAttentionBlocksPerSm(const WindowAttentionArgs& a, bool exact, int* blocks) {
  // Per (head-dim bucket, operand precision); one architecture per process.
  static std::atomic<int> cache[2][2] = {};
  const int bucket = a.head_dim <= 64 ? 0 : 1;
  std::atomic<int>& entry = cache[bucket][exact ? 1 : 0];
  *blocks = entry.load(std::memory_order_relaxed);
  if (*blocks > 0) return cudaSuccess;
  const cudaError_t error = bucket == 0 ? (exact ? Occupancy<64, true>(blocks)
                                                 : Occupancy<64, false>(blocks))
                                        : (exact ? Occupancy<128, true>(blocks)
                                                 : Occupancy<128, false>(blocks));
  if (error != cudaSuccess) return error;
  entry.store(*blocks, std::memory_order_relaxed);
  return cudaSuccess;
}

cudaError_t LaunchMmaTileBounds(const int32_t* slot_pos, int64_t num_slots, int32_t* tile_min,
                                cudaStream_t stream) {
  if (slot_pos == nullptr || tile_min == nullptr || num_slots <= 0) return cudaErrorInvalidValue;
  const int64_t tiles = (num_slots + kTile - 1) / kTile;
  constexpr int kSummaryThreads = 256;
  constexpr int kTilesPerBlock = kSummaryThreads / kWarpSize;
  TileBoundsKernel<<<static_cast<unsigned>((tiles + kTilesPerBlock - 1) / kTilesPerBlock),
                     kSummaryThreads, 0, stream>>>(slot_pos, num_slots, tile_min,
                                                   tile_min + tiles);
  return cudaGetLastError();
}

cudaError_t LaunchMmaAttention(const WindowAttentionArgs& a, int64_t row_tiles, int64_t splits,
                               int64_t slots_per_split, bool exact, int32_t* tile_min,
                               float* part_o, float* part_lse, float* scores,
                               cudaStream_t stream) {
  if (!MmaAttentionSupports(a) || tile_min == nullptr || slots_per_split % kTile != 0 ||
      row_tiles <= 0 || splits <= 0 || a.num_slots <= 0) {
    return cudaErrorInvalidValue;
  }
  const cudaError_t error = LaunchMmaTileBounds(a.slot_pos, a.num_slots, tile_min, stream);
  if (error != cudaSuccess) return error;
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(a.num_kv_heads),
                  static_cast<unsigned>(splits));
  if (a.head_dim <= 64) {
    auto launch = exact ? Launch<64, true> : Launch<64, false>;
    return launch(a, grid, slots_per_split, tile_min, part_o, part_lse, scores, stream);
  }
  auto launch = exact ? Launch<128, true> : Launch<128, false>;
  return launch(a, grid, slots_per_split, tile_min, part_o, part_lse, scores, stream);
}

}  // namespace tandem::gpu_worker::cuda_backend
