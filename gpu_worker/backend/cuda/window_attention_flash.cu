// Fast tensor-core window attention (window_attention_flash.cuh): mma.sync m16n8k16 with bf16 q
// and p, f32 accumulation, 128 query rows per block.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>

#include "attention_common.cuh"
#include "device_utils.cuh"
#include "mma_utils.cuh"
#include "window_attention_flash.cuh"
#include "window_attention_mma.cuh"
#if TANDEM_HOPPER_ATTENTION
#include "window_attention_hopper.cuh"
#endif

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kTile = static_cast<int>(kFlashSlotTile);
static_assert(kFlashSlotTile == kMmaSlotTile, "the kernels share the position summary");
constexpr int kStages = 2;  // K/V tiles: one computed while the next one loads
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// One warp layout: kWarps warps of kMTiles m16 tiles each (kRows = 128 query rows), head dims
// up to kD. Shared memory: q [kRows][kD] bf16, then kStages stages of K and V [kTile][kD] bf16
// and the tile's slot positions [kTile] (-1 = empty or past the split); rows of 16-byte chunks
// swizzled by SwizzledOffset.
template <int kD, int kWarps, int kMTiles>
struct FlashConfig {
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kRows = kWarps * kMTiles * 16;
  static constexpr int kChunks = kD / 8;                   // 16-byte chunks per row
  static constexpr int kThreadsPerRow = kThreads / kTile;  // loader threads per K/V tile row
  static constexpr int kLoadChunks = kChunks / kThreadsPerRow;
  static constexpr size_t kQBytes = size_t{kRows} * kD * sizeof(__nv_bfloat16);
  static constexpr size_t kTileBytes = size_t{kTile} * kD * sizeof(__nv_bfloat16);
  static constexpr size_t kStageBytes = 2 * kTileBytes + kTile * sizeof(int);
  static constexpr size_t kSmemBytes = kQBytes + kStages * kStageBytes;
  static_assert(kRows == kFlashRowsPerBlock);
  static_assert(kThreads % kTile == 0 && kChunks % kThreadsPerRow == 0);
};

// grid [row_tiles, num_kv_heads, splits], kWarps warps; two blocks per multiprocessor (the
// register cap of __launch_bounds__). Warp w owns the m16 tiles w·kMTiles + i of the block's
// rows; lane holds the mma fragment rows lane/4 and lane/4 + 8 of each. Per 64-slot tile:
// S = Q·Kᵀ (Q and K through ldmatrix), the position mask, the online softmax on S's
// accumulators (log2 units: q carries scale·log2e), p rounded to bf16 into P's A fragments,
// O += P·V (V through ldmatrix.trans). The next tile's cp.async runs during this one.
template <int kD, int kWarps, int kMTiles, bool kPadded>
__global__ void __launch_bounds__(kWarps* kWarpSize, 2)
    FlashAttentionKernel(WindowAttentionArgs a, int64_t slots_per_split, const int32_t* tile_min,
                         const int32_t* tile_max, float* part_o, float* part_lse) {
  using C = FlashConfig<kD, kWarps, kMTiles>;
  // !kPadded: head_dim == kD, so the checks for the zero padding past head_dim drop out.
  const int head_dim = kPadded ? static_cast<int>(a.head_dim) : kD;
  constexpr int kKSteps = kD / 16;      // k-steps of Q·Kᵀ
  constexpr int kDimTiles = kD / 8;     // n-tiles of O
  constexpr int kKeyTiles = kTile / 8;  // n-tiles of S
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int red[4][kWarps];
  AllowDependentLaunch();  // the split combine may be scheduled now (it waits for us)

  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem);
  unsigned char* stage_base = smem + C::kQBytes;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  // 32-bit row and slot indices: T·G and num_slots are far below 2^31 (the backend's checks).
  const int g = blockIdx.y;
  const int row0 = (gridDim.x - 1 - blockIdx.x) * C::kRows;  // latest rows first
  const int split = blockIdx.z;
  const int group = static_cast<int>(a.num_q_heads / a.num_kv_heads);
  const int rows = static_cast<int>(a.num_tokens) * group;
  const float scale_log2 = a.scale * kLog2e;

  // q · scale·log2e as bf16, zero past head_dim and for rows past T·G.
  for (int i = threadIdx.x; i < C::kRows * C::kChunks; i += C::kThreads) {
    const int r = i / C::kChunks;
    const int c = i % C::kChunks;
    const int row = row0 + r;
    float x[8] = {};
    if (row < rows && c * 8 < head_dim) {
      const float* src =
          a.q + (row / group) * a.q_row_stride + (g * group + row % group) * a.head_dim + c * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] = src[e] * scale_log2;
    }
    uint4 packed;
    packed.x = Bits(__floats2bfloat162_rn(x[0], x[1]));
    packed.y = Bits(__floats2bfloat162_rn(x[2], x[3]));
    packed.z = Bits(__floats2bfloat162_rn(x[4], x[5]));
    packed.w = Bits(__floats2bfloat162_rn(x[6], x[7]));
    *reinterpret_cast<uint4*>(qs + SwizzledOffset<kD>(r, c)) = packed;
  }

  // This lane's rows (a = lane/4 and b = a + 8 of each m16 tile) and their positions.
  int qpos_a[kMTiles], qpos_b[kMTiles];
  int max_q = -1, min_q = INT_MAX;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    const int row_a = row0 + (warp * kMTiles + mt) * 16 + lane / 4;
    qpos_a[mt] = row_a < rows ? a.q_pos[row_a / group] : -1;  // -1: sees nothing
    qpos_b[mt] = row_a + 8 < rows ? a.q_pos[(row_a + 8) / group] : -1;
    max_q = max(max_q, max(qpos_a[mt], qpos_b[mt]));
    min_q = min(min_q, min(qpos_a[mt], qpos_b[mt]));  // -1 with padding rows
  }
  max_q = __reduce_max_sync(kFullMask, max_q);
  min_q = __reduce_min_sync(kFullMask, min_q);
  if (lane == 0) {
    red[0][warp] = max_q;
    red[1][warp] = min_q;
  }
  __syncthreads();  // also publishes qs
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    max_q = max(max_q, red[0][w]);
    min_q = min(min_q, red[1][w]);
  }

  // The tiles of this split that hold a position some row of the block can see.
  const int s_begin = split * static_cast<int>(slots_per_split);
  const int s_end = static_cast<int>(min(a.num_slots, int64_t{s_begin} + slots_per_split));
  const int tile_begin = s_begin / kTile;
  const int tiles = static_cast<int>((s_end - s_begin + kTile - 1) / kTile);
  int first = INT_MAX, last = -1;
  for (int j = threadIdx.x; j < tiles; j += C::kThreads) {
    if (tile_min[tile_begin + j] <= max_q) {
      first = min(first, j);
      last = max(last, j);
    }
  }
  first = __reduce_min_sync(kFullMask, first);
  last = __reduce_max_sync(kFullMask, last);
  if (lane == 0) {
    red[2][warp] = first;
    red[3][warp] = last;
  }
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    first = min(first, red[2][w]);
    last = max(last, red[3][w]);
  }

  float o[kMTiles][kDimTiles][4];
  float m_a[kMTiles], m_b[kMTiles];  // running max of the log2-unit scores
  float l_a[kMTiles], l_b[kMTiles];  // this lane's share of Σ p̃ (p rounded to bf16)
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    m_a[mt] = m_b[mt] = -INFINITY;
    l_a[mt] = l_b[mt] = 0.0f;
#pragma unroll
    for (int nd = 0; nd < kDimTiles; ++nd)
      o[mt][nd][0] = o[mt][nd][1] = o[mt][nd][2] = o[mt][nd][3] = 0.0f;
  }

  const __nv_bfloat16* k_head =
      static_cast<const __nv_bfloat16*>(a.k_cache) + g * a.capacity * a.head_dim;
  const __nv_bfloat16* v_head =
      static_cast<const __nv_bfloat16*>(a.v_cache) + g * a.capacity * a.head_dim;
  // Loader: thread i copies chunks (i % kThreadsPerRow) + kThreadsPerRow·c of tile row
  // i / kThreadsPerRow and fetches that row's slot position.
  const int ld_row = threadIdx.x / C::kThreadsPerRow;
  const int ld_chunk0 = threadIdx.x % C::kThreadsPerRow;
  const int valid_chunks = head_dim / 8;
  auto keys_of = [&](int stage) {
    return reinterpret_cast<__nv_bfloat16*>(stage_base + stage * C::kStageBytes);
  };
  // Queues tile j's copies into its stage; returns the slot position of this thread's row
  // (-1: empty, past the split, or j past `last`).
  auto issue = [&](int j) -> int {
    if (j > last) return -1;
    __nv_bfloat16* ks = keys_of((j - first) % kStages);
    __nv_bfloat16* vs = ks + kTile * kD;
    const int s = (tile_begin + j) * kTile + ld_row;
    const bool in = s < s_end;
    const int64_t row = in ? s : s_begin;  // a readable row for the zero-fill copies
#pragma unroll
    for (int i = 0; i < C::kLoadChunks; ++i) {
      const int c = ld_chunk0 + C::kThreadsPerRow * i;
      const bool valid = in && c < valid_chunks;
      const int64_t offset = row * a.head_dim + (valid ? c * 8 : 0);
      CpAsync16(SmemAddr(ks + SwizzledOffset<kD>(ld_row, c)), k_head + offset, valid);
      CpAsync16(SmemAddr(vs + SwizzledOffset<kD>(ld_row, c)), v_head + offset, valid);
    }
    CpAsyncCommit();
    return in ? a.slot_pos[s] : -1;
  };

  if (first <= last) {
    int pos_next = issue(first);  // this thread's slot position in the tile in flight
    for (int j = first; j <= last; ++j) {
      __nv_bfloat16* ks = keys_of((j - first) % kStages);
      __nv_bfloat16* vs = ks + kTile * kD;
      int* spos = reinterpret_cast<int*>(vs + kTile * kD);
      const int pos = pos_next;
      CpAsyncWait<0>();  // tile j has landed (this thread's copies)
      // NOTE: an empty slot's V row may be unwritten memory (NaN); its weight is 0, but
      // 0·NaN = NaN in the mma, so the row is zeroed (by the threads that copied it). Its K row
      // only makes a NaN score, which the mask replaces.
      if (pos < 0) {
#pragma unroll
        for (int i = 0; i < C::kLoadChunks; ++i) {
          *reinterpret_cast<uint4*>(vs +
                                    SwizzledOffset<kD>(ld_row, ld_chunk0 + C::kThreadsPerRow * i)) =
              make_uint4(0, 0, 0, 0);
        }
      }
      if (ld_chunk0 == 0) spos[ld_row] = pos;
      __syncthreads();  // tile j is visible to every warp; tile j - 1's stage is free
      pos_next = issue(j + 1);
      // Every slot of the tile holds a position every row of the block sees: no mask.
      const bool unmasked = tile_max[tile_begin + j] <= min_q;  // block-uniform

      // S = Q·Kᵀ: per k-step, Q's A fragment (ldmatrix.x4: rows lane & 15, chunk + lane / 16)
      // and K's B fragments of two 8-key n-tiles (ldmatrix.x4: keys + 8·(lane / 16), chunk +
      // (lane / 8) % 2).
      float s[kMTiles][kKeyTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
          s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
        }
      }
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        if (kk * 16 >= head_dim) break;  // zero padding (block-uniform)
        uint32_t qa[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          const int r = (warp * kMTiles + mt) * 16 + (lane & 15);
          LdMatrixX4(SmemAddr(qs + SwizzledOffset<kD>(r, 2 * kk + (lane >> 4))), qa[mt]);
        }
#pragma unroll
        for (int n = 0; n < kKeyTiles; n += 2) {
          uint32_t b[4];
          LdMatrixX4(SmemAddr(ks + SwizzledOffset<kD>((n + (lane >> 4)) * 8 + (lane & 7),
                                                      2 * kk + ((lane >> 3) & 1))),
                     b);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            Mma(s[mt][n], qa[mt], b[0], b[1]);
            Mma(s[mt][n + 1], qa[mt], b[2], b[3]);
          }
        }
      }

      // Mask by position (accumulator layout: s[n][0..1] row a, s[n][2..3] row b, keys
      // 8n + 2(lane%4) + {0, 1}), the online softmax, and p̃ = bf16(p) packed as P's A
      // fragments: p[mt][n][0] row a's pair of keys, p[mt][n][1] row b's.
      uint32_t p[kMTiles][kKeyTiles][2];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        if (!unmasked) {
#pragma unroll
          for (int n = 0; n < kKeyTiles; ++n) {
            const int2 sp = *reinterpret_cast<const int2*>(spos + n * 8 + 2 * (lane & 3));
            s[mt][n][0] = (sp.x >= 0 && sp.x <= qpos_a[mt]) ? s[mt][n][0] : -INFINITY;
            s[mt][n][1] = (sp.y >= 0 && sp.y <= qpos_a[mt]) ? s[mt][n][1] : -INFINITY;
            s[mt][n][2] = (sp.x >= 0 && sp.x <= qpos_b[mt]) ? s[mt][n][2] : -INFINITY;
            s[mt][n][3] = (sp.y >= 0 && sp.y <= qpos_b[mt]) ? s[mt][n][3] : -INFINITY;
          }
        }
        float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
          mx_a = fmaxf(mx_a, fmaxf(s[mt][n][0], s[mt][n][1]));
          mx_b = fmaxf(mx_b, fmaxf(s[mt][n][2], s[mt][n][3]));
        }
        const auto [base_a, base_b, corr_a, corr_b] =
            OnlineSoftmaxStep(mx_a, mx_b, &m_a[mt], &m_b[mt]);
        l_a[mt] *= corr_a;
        l_b[mt] *= corr_b;
        if (__any_sync(kFullMask, corr_a != 1.0f || corr_b != 1.0f)) {  // a row's max moved
#pragma unroll
          for (int nd = 0; nd < kDimTiles; ++nd) {
            o[mt][nd][0] *= corr_a;
            o[mt][nd][1] *= corr_a;
            o[mt][nd][2] *= corr_b;
            o[mt][nd][3] *= corr_b;
          }
        }
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
          const __nv_bfloat162 pa =
              __floats2bfloat162_rn(Exp2(s[mt][n][0] - base_a), Exp2(s[mt][n][1] - base_a));
          const __nv_bfloat162 pb =
              __floats2bfloat162_rn(Exp2(s[mt][n][2] - base_b), Exp2(s[mt][n][3] - base_b));
          const float2 fa = __bfloat1622float2(pa);
          const float2 fb = __bfloat1622float2(pb);
          l_a[mt] += fa.x + fa.y;
          l_b[mt] += fb.x + fb.y;
          p[mt][n][0] = Bits(pa);
          p[mt][n][1] = Bits(pb);
        }
      }

      // O += P·V: P's A fragment for keys 16kk .. 16kk + 15 is S's n-tiles 2kk and 2kk + 1;
      // V's B fragments for two 8-dim n-tiles per ldmatrix.x4.trans.
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int nd = 0; nd < kDimTiles; nd += 2) {
          if (nd * 8 >= head_dim) break;  // zero padding (block-uniform)
          uint32_t b[4];
          LdMatrixX4Trans(SmemAddr(vs + SwizzledOffset<kD>(key, nd + (lane >> 4))), b);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            const uint32_t pf[4] = {p[mt][2 * kk][0], p[mt][2 * kk][1], p[mt][2 * kk + 1][0],
                                    p[mt][2 * kk + 1][1]};
            Mma(o[mt][nd], pf, b[0], b[1]);
            Mma(o[mt][nd + 1], pf, b[2], b[3]);
          }
        }
      }
    }
  }

  // Epilogue: l summed over the 4 lanes of a row; o = O / l, lse = (m + log2 l)·ln2.
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    float la = l_a[mt], lb = l_b[mt];
    la += __shfl_xor_sync(kFullMask, la, 1);
    la += __shfl_xor_sync(kFullMask, la, 2);
    lb += __shfl_xor_sync(kFullMask, lb, 1);
    lb += __shfl_xor_sync(kFullMask, lb, 2);
    const int row_a = row0 + (warp * kMTiles + mt) * 16 + lane / 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row_a + 8 * half;
      if (row >= rows) continue;
      const float m = half == 0 ? m_a[mt] : m_b[mt];
      const float l = half == 0 ? la : lb;
      const bool empty = m == -INFINITY;
      const float inv = empty ? 0.0f : 1.0f / l;
      const float lse = empty ? -INFINITY : (m + log2f(l)) * kLn2;
      const int64_t out_row = (row / group) * a.num_q_heads + g * group + row % group;
      float* dst_o = a.o;
      float* dst_lse = a.lse;
      int64_t dst_row = out_row;
      if (part_o != nullptr) {
        dst_o = part_o;
        dst_lse = part_lse;
        dst_row = int64_t{split} * a.num_tokens * a.num_q_heads + out_row;
      }
#pragma unroll
      for (int nd = 0; nd < kDimTiles; ++nd) {
        const int col = nd * 8 + 2 * (lane & 3);
        if (col < head_dim) {
          *reinterpret_cast<float2*>(dst_o + dst_row * a.head_dim + col) =
              make_float2(o[mt][nd][2 * half] * inv, o[mt][nd][2 * half + 1] * inv);
        }
      }
      if ((lane & 3) == 0) dst_lse[dst_row] = lse;
    }
  }
}

template <int kD, int kWarps, int kMTiles, bool kPadded>
cudaError_t Prepare() {
  return cudaFuncSetAttribute(FlashAttentionKernel<kD, kWarps, kMTiles, kPadded>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(FlashConfig<kD, kWarps, kMTiles>::kSmemBytes));
}

// Calls run.template operator()<kD, kWarps, kMTiles, kPadded>() for a's head-dim bucket kD,
// the variant's warp layout, and kPadded = head_dim < kD.
template <int kWarps, int kMTiles, typename Run>
cudaError_t DispatchDim(int64_t head_dim, const Run& run) {
  if (head_dim == 64) return run.template operator()<64, kWarps, kMTiles, false>();
  if (head_dim < 64) return run.template operator()<64, kWarps, kMTiles, true>();
  if (head_dim == 128) return run.template operator()<128, kWarps, kMTiles, false>();
  return run.template operator()<128, kWarps, kMTiles, true>();
}
template <typename Run>
cudaError_t Dispatch(int64_t head_dim, int variant, const Run& run) {
  if (variant == 0) return DispatchDim<8, 1>(head_dim, run);
  if (variant == 1) return DispatchDim<4, 2>(head_dim, run);
  return cudaErrorInvalidValue;
}

struct OccupancyQuery {
  int* blocks;
  template <int kD, int kWarps, int kMTiles, bool kPadded>
  cudaError_t operator()() const {
    using C = FlashConfig<kD, kWarps, kMTiles>;
    const cudaError_t error = Prepare<kD, kWarps, kMTiles, kPadded>();
    if (error != cudaSuccess) return error;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        blocks, FlashAttentionKernel<kD, kWarps, kMTiles, kPadded>, C::kThreads, C::kSmemBytes);
  }
};

struct Launcher {
  const WindowAttentionArgs& a;
  dim3 grid;
  int64_t slots_per_split;
  const int32_t* tile_min;
  float* part_o;
  float* part_lse;
  cudaStream_t stream;
  template <int kD, int kWarps, int kMTiles, bool kPadded>
  cudaError_t operator()() const {
    using C = FlashConfig<kD, kWarps, kMTiles>;
    const cudaError_t error = Prepare<kD, kWarps, kMTiles, kPadded>();
    if (error != cudaSuccess) return error;
    FlashAttentionKernel<kD, kWarps, kMTiles, kPadded>
        <<<grid, C::kThreads, C::kSmemBytes, stream>>>(a, slots_per_split, tile_min,
                                                       tile_min + (a.num_slots + kTile - 1) / kTile,
                                                       part_o, part_lse);
    return cudaGetLastError();
  }
};

}  // namespace

bool FlashAttentionSupports(const WindowAttentionArgs& a) {
  return a.cache_dtype == DType::kBF16 && a.head_dim <= 128 && a.maw == nullptr;
}

bool FlashVariantAvailable(const WindowAttentionArgs& a, int variant) {
  if (!FlashAttentionSupports(a) || variant < 0 || variant >= kFlashVariants) return false;
  if (variant != kFlashHopperVariant) return true;
#if TANDEM_HOPPER_ATTENTION
  return HopperAttentionSupports(a) && HopperAttentionAvailable();
#else
  return false;
#endif
}

int PreferredFlashVariant(const WindowAttentionArgs& a) {
  return FlashVariantAvailable(a, kFlashHopperVariant) ? kFlashHopperVariant : kFlashDefaultVariant;
}

cudaError_t FlashAttentionBlocksPerSm(const WindowAttentionArgs& a, int variant, int* blocks) {
  if (variant < 0 || variant >= kFlashVariants) return cudaErrorInvalidValue;
  if (variant == kFlashHopperVariant) {
    *blocks = 1;  // 227 KiB of shared memory and __launch_bounds__(384, 1)
    return FlashVariantAvailable(a, variant) ? cudaSuccess : cudaErrorNotSupported;
  }
  // Per (head-dim bucket, variant); one architecture per process.
  static std::atomic<int> cache[2][kFlashVariants] = {};
  std::atomic<int>& entry = cache[a.head_dim <= 64 ? 0 : 1][variant];
  *blocks = entry.load(std::memory_order_relaxed);
  if (*blocks > 0) return cudaSuccess;
  const cudaError_t error = Dispatch(a.head_dim, variant, OccupancyQuery{blocks});
  if (error != cudaSuccess) return error;
  entry.store(*blocks, std::memory_order_relaxed);
  return cudaSuccess;
}

cudaError_t LaunchFlashAttention(const WindowAttentionArgs& a, int variant, int64_t row_tiles,
                                 int64_t splits, int64_t slots_per_split, int32_t* tile_min,
                                 float* part_o, float* part_lse, cudaStream_t stream) {
  if (!FlashAttentionSupports(a) || tile_min == nullptr || slots_per_split % kTile != 0 ||
      row_tiles <= 0 || splits <= 0 || a.num_slots <= 0 || variant < 0 ||
      variant >= kFlashVariants) {
    return cudaErrorInvalidValue;
  }
  if (!FlashVariantAvailable(a, variant)) return cudaErrorNotSupported;
  const cudaError_t error = LaunchMmaTileBounds(a.slot_pos, a.num_slots, tile_min, stream);
  if (error != cudaSuccess) return error;
#if TANDEM_HOPPER_ATTENTION
  if (variant == kFlashHopperVariant) {
    return LaunchHopperAttention(a, row_tiles, splits, slots_per_split, tile_min,
                                 tile_min + (a.num_slots + kTile - 1) / kTile, part_o, part_lse,
                                 stream);
  }
#endif
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(a.num_kv_heads),
                  static_cast<unsigned>(splits));
  return Dispatch(a.head_dim, variant,
                  Launcher{a, grid, slots_per_split, tile_min, part_o, part_lse, stream});
}

}  // namespace tandem::gpu_worker::cuda_backend
