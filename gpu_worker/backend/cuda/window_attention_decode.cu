// Streaming tensor-core decode kernel (window_attention_decode.cuh).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "attention_common.cuh"
#include "device_utils.cuh"
#include "mma_utils.cuh"
#include "window_attention_decode.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

// 8 warps of 16-slot tiles: two warps per scheduler, so one's loads and mma latencies hide
// behind the other's work (4 warps of 32-slot tiles, one per scheduler, were bound by
// instruction latency at 32K slots), in the same shared memory.
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kRows = static_cast<int>(kDecodeStreamRows);  // one m16 fragment
constexpr int kTile = 16;    // slots per warp tile
constexpr int kStages = 3;   // tiles in flight per warp
static_assert(kTile <= kWarpSize, "a lane per tile slot copies its position and fixes its row");
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// One pipeline stage of one warp: K and V tiles [kTile][kD] bf16 (swizzled 16-byte chunks),
// then the tile's slot positions [kTile] (-1 = empty or past the split).
template <int kD>
struct DecodeStage {
  static constexpr int kChunks = kD / 8;
  static constexpr size_t kTileBytes = size_t{kTile} * kD * sizeof(__nv_bfloat16);
  static constexpr size_t kBytes = 2 * kTileBytes + kTile * sizeof(int);
  static constexpr size_t kPipelineBytes = size_t{kWarps} * kStages * kBytes;
  // After the loop the same memory holds the warps' states: o [kWarps][kRows][kD] f32, then
  // m and l [kWarps][kRows] each.
  static constexpr size_t kMergeBytes = sizeof(float) * kWarps * kRows * (kD + 2);
  static constexpr size_t kSmemBytes = kPipelineBytes > kMergeBytes ? kPipelineBytes : kMergeBytes;
};

// The fused split merge (flash-decoding's combine without a second launch). Every block of a
// (row tile, kv head) has written its split's partial state; the one that counts itself last
// on `counter` merges the `splits` states of its 16 rows into o / lse, as CombineSplitsKernel
// does (weights e^(lse_i - m), o = Σ w_i·o_i / Σ w_i, lse = m + log Σ w_i; all splits empty:
// o = 0, lse = -inf), then re-arms the counter to 0 for the next launch on the stream.
// `smem`: at least 4·(kRows·(splits + 2)) bytes, free (the caller's merge is done).
__device__ __forceinline__ void MergeSplits(const WindowAttentionArgs& a, int64_t g, int64_t row0,
                                            int64_t splits, const float* part_o,
                                            const float* part_lse, float* smem,
                                            unsigned* counter) {
  __shared__ unsigned arrived;
  __threadfence();  // this block's partial state is visible before its arrival counts
  __syncthreads();  // ... for every thread's stores; the caller's reads of smem are done
  if (threadIdx.x == 0) arrived = atomicAdd(counter, 1u);
  __syncthreads();
  if (static_cast<int64_t>(arrived) != splits - 1) return;
  __threadfence();  // the other blocks' partial states are visible to this one
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t group = a.num_q_heads / a.num_kv_heads;
  const int64_t rows = a.num_tokens * group;
  const int64_t split_stride = a.num_tokens * a.num_q_heads;  // rows of one split's state
  float* weights = smem;                    // [kRows][splits]
  float* row_m = weights + kRows * splits;  // [kRows]
  float* row_l = row_m + kRows;             // [kRows]
  for (int r = warp; r < kRows; r += kWarps) {
    const int64_t row = row0 + r;
    if (row >= rows) continue;
    const int64_t out_row = (row / group) * a.num_q_heads + g * group + row % group;
    float m = -INFINITY;
    for (int64_t i = lane; i < splits; i += kWarpSize) {
      m = fmaxf(m, __ldcg(part_lse + i * split_stride + out_row));
    }
    m = WarpMax(m);
    float l = 0.0f;
    for (int64_t i = lane; i < splits; i += kWarpSize) {
      const float c = m == -INFINITY ? 0.0f : expf(__ldcg(part_lse + i * split_stride + out_row) - m);
      weights[r * splits + i] = c;
      l += c;
    }
    l = WarpSum(l);
    if (lane == 0) {
      row_m[r] = m;
      row_l[r] = l;
    }
  }
  __syncthreads();
  const int head_dim = static_cast<int>(a.head_dim);
  for (int idx = threadIdx.x; idx < kRows * head_dim; idx += kThreads) {
    const int r = idx / head_dim;
    const int d = idx % head_dim;
    const int64_t row = row0 + r;
    if (row >= rows) continue;
    const int64_t out_row = (row / group) * a.num_q_heads + g * group + row % group;
    const float m = row_m[r];
    if (m == -INFINITY) {
      a.o[out_row * a.head_dim + d] = 0.0f;
      if (d == 0) a.lse[out_row] = -INFINITY;
      continue;
    }
    const float* w = weights + r * splits;
    const float* src = part_o + out_row * a.head_dim + d;
    const int64_t stride = split_stride * a.head_dim;
    float acc = 0.0f;
#pragma unroll 4
    for (int64_t i = 0; i < splits; ++i) acc = fmaf(w[i], __ldcg(src + i * stride), acc);
    const float l = row_l[r];
    a.o[out_row * a.head_dim + d] = acc / l;
    if (d == 0) a.lse[out_row] = m + logf(l);
  }
  if (threadIdx.x == 0) *counter = 0u;
}

// One block's work: the 16 query rows r = row0 .. row0 + 15 (r = t·G + j) of kv head g form
// one m16 fragment that every warp holds (q split into bf16 hi + lo), against the slots of split
// `split`. Warp w streams the kTile-slot tiles w, w + kWarps, ... of the split through its own
// cp.async pipeline (no block barrier in the loop): S = Q·Kᵀ on tensor cores, the position mask,
// the online softmax, O += P·V (P split into hi + lo). The kWarps warp states are merged through
// shared memory `smem` (DecodeStage<kD>::kSmemBytes) at the end. Shared by the single and the
// batched kernel, so both compute bit-identical results for the same split. With `counter` (split
// partial states only), the last of the `splits` blocks of this (row tile, kv head) to finish
// merges the partial states into o / lse (MergeSplits).
// kPacked: the block has at most 8 rows (a decode token's GQA group, G <= 8), so fragment rows
// 8..15 (each lane's "row b") are padding; they carry the lo halves of row a instead. One mma
// then gives q_hi·k in row a and q_lo·k in row b (summed in the lane that holds both), and P·V
// takes p_hi in row a and p_lo in row b (O = the two rows' sum at the end): half the tensor-core
// work of the hi + lo pairs, the same products.
template <int kD, bool kPacked>
__device__ __forceinline__ void DecodeStreamBlock(const WindowAttentionArgs& a, int64_t g,
                                                  int64_t row0, int64_t split,
                                                  int64_t slots_per_split, float* part_o,
                                                  float* part_lse, float* scores,
                                                  unsigned char* smem, unsigned* counter,
                                                  int64_t splits) {
  using T = __nv_bfloat16;
  using Stage = DecodeStage<kD>;
  static_assert(sizeof(float) * kRows * (kMaxFusedSplits + 2) <= Stage::kSmemBytes,
                "MergeSplits' weights fit the shared memory");
  constexpr int kKSteps = kD / 16;
  constexpr int kDimTiles = kD / 8;
  constexpr int kKeyTiles = kTile / 8;
  constexpr int kChunks = Stage::kChunks;
  constexpr int kRowsPerCopy = kWarpSize / kChunks;  // tile rows one warp-wide copy covers

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t group = a.num_q_heads / a.num_kv_heads;
  const int64_t rows = a.num_tokens * group;
  const int head_dim = static_cast<int>(a.head_dim);

  const int64_t row_a = row0 + lane / 4;
  const int64_t row_b = row_a + 8;
  const int qpos_a = row_a < rows ? a.q_pos[row_a / group] : -1;  // -1: sees nothing
  const int qpos_b = row_b < rows ? a.q_pos[row_b / group] : -1;

  // Q fragments, as in the prefill kernel (registers 0/1: rows a/b at columns 2(lane%4) + {0,1}
  // of the k-step, registers 2/3: 8 columns on; kPacked: registers 1/3 hold row a's lo half).
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
        if constexpr (kPacked) {  // row b: row a's lo half
          q_hi[kk][2 * half + 1] = q_lo[kk][2 * half];
        } else {
          SplitBf16(xb0, xb1, q_hi[kk][2 * half + 1], q_lo[kk][2 * half + 1]);
        }
      }
    }
  }

  const int64_t s_begin = split * slots_per_split;
  const int64_t s_end = min(a.num_slots, s_begin + slots_per_split);
  const T* k_head = static_cast<const T*>(a.k_cache) + g * a.capacity * a.head_dim;
  const T* v_head = static_cast<const T*>(a.v_cache) + g * a.capacity * a.head_dim;
  unsigned char* warp_smem = smem + warp * kStages * Stage::kBytes;
  const int64_t first_base = s_begin + warp * kTile;
  constexpr int64_t kBaseStep = int64_t{kWarps} * kTile;
  const int tiles = first_base < s_end
                        ? static_cast<int>((s_end - first_base + kBaseStep - 1) / kBaseStep)
                        : 0;
  const int valid_chunks = head_dim / 8;

  // Queues tile i's copies into its stage; always commits a group (empty past the last tile)
  // so that wait_group counts the same groups every iteration.
  auto issue = [&](int i) {
    if (i < tiles) {
      unsigned char* st = warp_smem + (i % kStages) * Stage::kBytes;
      T* ks = reinterpret_cast<T*>(st);
      T* vs = reinterpret_cast<T*>(st + Stage::kTileBytes);
      int* spos = reinterpret_cast<int*>(st + 2 * Stage::kTileBytes);
      const int64_t base = first_base + i * kBaseStep;
      const int c = lane % kChunks;
#pragma unroll
      for (int r0 = 0; r0 < kTile; r0 += kRowsPerCopy) {
        const int r = r0 + lane / kChunks;
        const int64_t s = base + r;
        const bool valid = s < s_end && c < valid_chunks;
        const int64_t offset = (valid ? s : base) * a.head_dim + (valid ? c * 8 : 0);
        CpAsync16(SmemAddr(ks + SwizzledOffset<kD>(r, c)), k_head + offset, valid);
        CpAsync16(SmemAddr(vs + SwizzledOffset<kD>(r, c)), v_head + offset, valid);
      }
      const int64_t s = base + lane;
      if (lane < kTile) {
        CpAsync4(SmemAddr(spos + lane), a.slot_pos + (s < s_end ? s : base), s < s_end);
      }
    }
    CpAsyncCommit();
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);

  float o[kDimTiles][4];
#pragma unroll
  for (int nd = 0; nd < kDimTiles; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;
  float m_a = -INFINITY, m_b = -INFINITY;  // running max of score·log2(e)
  float l_a = 0.0f, l_b = 0.0f;            // this lane's share of Σ 2^(score·log2e - m)
  const float scale_log2 = a.scale * kLog2e;

  for (int i = 0; i < tiles; ++i) {
    issue(i + kStages - 1);
    CpAsyncWait<kStages - 1>();  // tile i has landed (this lane's copies) ...
    __syncwarp();                // ... and every lane's
    unsigned char* st = warp_smem + (i % kStages) * Stage::kBytes;
    T* ks = reinterpret_cast<T*>(st);
    T* vs = reinterpret_cast<T*>(st + Stage::kTileBytes);
    int* spos = reinterpret_cast<int*>(st + 2 * Stage::kTileBytes);
    const int64_t base = first_base + i * kBaseStep;
    // Lane j fixes up tile row j: -1 past the split (the copy wrote 0), and an empty slot's V
    // row zeroed. NOTE: unwritten cache memory may hold NaN, and 0·NaN = NaN in the mma.
    if (lane < kTile) {
      const bool past = base + lane >= s_end;
      if (past || spos[lane] < 0) {
        spos[lane] = -1;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          *reinterpret_cast<uint4*>(vs + SwizzledOffset<kD>(lane, c)) = make_uint4(0, 0, 0, 0);
        }
      }
    }
    __syncwarp();

    float s[kKeyTiles][4];
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kKSteps; kk += 2) {
      if (kk * 16 >= head_dim) break;  // zero padding (warp-uniform)
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
        uint32_t b[4];
        LdMatrixX4(SmemAddr(ks + SwizzledOffset<kD>(n * 8 + (lane & 7), kk * 2 + (lane >> 3))), b);
        Mma(s[n], q_hi[kk], b[0], b[1]);
        if constexpr (!kPacked) Mma(s[n], q_lo[kk], b[0], b[1]);
        Mma(s[n], q_hi[kk + 1], b[2], b[3]);
        if constexpr (!kPacked) Mma(s[n], q_lo[kk + 1], b[2], b[3]);
      }
    }
    if constexpr (kPacked) {  // row a's score = its hi product + its lo product (row b)
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
        s[n][0] += s[n][2];
        s[n][1] += s[n][3];
      }
    }

    // Mask by position; save the natural-unit scores for the MAW update; online softmax.
    float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
      const int col = n * 8 + 2 * (lane & 3);
      const int2 p = *reinterpret_cast<const int2*>(spos + col);
      const bool vis[4] = {p.x >= 0 && p.x <= qpos_a, p.y >= 0 && p.y <= qpos_a,
                           p.x >= 0 && p.x <= qpos_b, p.y >= 0 && p.y <= qpos_b};
      if (scores != nullptr) {  // [num_kv_heads, rows, num_slots]
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t row = e < 2 ? row_a : row_b;
          const int64_t slot = base + col + (e & 1);
          if (row < rows && slot < s_end) {
            scores[(g * rows + row) * a.num_slots + slot] = vis[e] ? s[n][e] * a.scale : -INFINITY;
          }
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = vis[e] ? s[n][e] * scale_log2 : -INFINITY;
      mx_a = fmaxf(mx_a, fmaxf(s[n][0], s[n][1]));
      mx_b = fmaxf(mx_b, fmaxf(s[n][2], s[n][3]));
    }
    const auto [base_a, base_b, corr_a, corr_b] = OnlineSoftmaxStep(mx_a, mx_b, &m_a, &m_b);
    l_a *= corr_a;
    l_b *= corr_b;
    if (__any_sync(kFullMask, corr_a != 1.0f || corr_b != 1.0f)) {  // a row's max moved
      // kPacked: row b's accumulators are row a's lo part
      const float corr_ob = kPacked ? corr_a : corr_b;
#pragma unroll
      for (int nd = 0; nd < kDimTiles; ++nd) {
        o[nd][0] *= corr_a;
        o[nd][1] *= corr_a;
        o[nd][2] *= corr_ob;
        o[nd][3] *= corr_ob;
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

#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      uint32_t p_hi[4], p_lo[4];
      SplitBf16(s[2 * kk][0], s[2 * kk][1], p_hi[0], p_lo[0]);
      SplitBf16(s[2 * kk + 1][0], s[2 * kk + 1][1], p_hi[2], p_lo[2]);
      if constexpr (kPacked) {  // row b: row a's lo half
        p_hi[1] = p_lo[0];
        p_hi[3] = p_lo[2];
      } else {
        SplitBf16(s[2 * kk][2], s[2 * kk][3], p_hi[1], p_lo[1]);
        SplitBf16(s[2 * kk + 1][2], s[2 * kk + 1][3], p_hi[3], p_lo[3]);
      }
      const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int nd = 0; nd < kDimTiles; nd += 2) {
        if (nd * 8 >= head_dim) break;  // zero padding (warp-uniform)
        uint32_t b[4];
        LdMatrixX4Trans(SmemAddr(vs + SwizzledOffset<kD>(key, nd + (lane >> 4))), b);
        Mma(o[nd], p_hi, b[0], b[1]);
        if constexpr (!kPacked) Mma(o[nd], p_lo, b[0], b[1]);
        Mma(o[nd + 1], p_hi, b[2], b[3]);
        if constexpr (!kPacked) Mma(o[nd + 1], p_lo, b[2], b[3]);
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }

  if constexpr (kPacked) {  // O of row a = its hi part + its lo part; row b is padding again
#pragma unroll
    for (int nd = 0; nd < kDimTiles; ++nd) {
      o[nd][0] += o[nd][2];
      o[nd][1] += o[nd][3];
      o[nd][2] = o[nd][3] = 0.0f;
    }
  }

  // Merge the kWarps warps' states (the pipeline memory is free once every copy has landed).
  CpAsyncWait<0>();
  __syncthreads();
  float* merge_o = reinterpret_cast<float*>(smem);        // [kWarps][kRows][kD]
  float* merge_m = merge_o + kWarps * kRows * kD;         // [kWarps][kRows], log2 units
  float* merge_l = merge_m + kWarps * kRows;              // [kWarps][kRows]
  l_a += __shfl_xor_sync(kFullMask, l_a, 1);
  l_a += __shfl_xor_sync(kFullMask, l_a, 2);
  l_b += __shfl_xor_sync(kFullMask, l_b, 1);
  l_b += __shfl_xor_sync(kFullMask, l_b, 2);
  const int ra = lane / 4;
  const int rb = ra + 8;
#pragma unroll
  for (int nd = 0; nd < kDimTiles; ++nd) {
    const int col = nd * 8 + 2 * (lane & 3);
    *reinterpret_cast<float2*>(merge_o + (warp * kRows + ra) * kD + col) =
        make_float2(o[nd][0], o[nd][1]);
    *reinterpret_cast<float2*>(merge_o + (warp * kRows + rb) * kD + col) =
        make_float2(o[nd][2], o[nd][3]);
  }
  if ((lane & 3) == 0) {
    merge_m[warp * kRows + ra] = m_a;
    merge_m[warp * kRows + rb] = m_b;
    merge_l[warp * kRows + ra] = l_a;
    merge_l[warp * kRows + rb] = l_b;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kRows * head_dim; idx += kThreads) {
    const int r = idx / head_dim;
    const int d = idx % head_dim;
    const int64_t row = row0 + r;
    if (row >= rows) continue;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, merge_m[w * kRows + r]);
    float value = 0.0f;
    float lse = -INFINITY;
    if (m != -INFINITY) {
      float l = 0.0f;
      float acc = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float c = Exp2(merge_m[w * kRows + r] - m);
        l = fmaf(merge_l[w * kRows + r], c, l);
        acc = fmaf(merge_o[(w * kRows + r) * kD + d], c, acc);
      }
      value = acc / l;
      lse = m * kLn2 + logf(l);
    }
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
  if (counter != nullptr && part_o != nullptr) {
    MergeSplits(a, g, row0, splits, part_o, part_lse, reinterpret_cast<float*>(smem), counter);
  }
}

// DecodeStreamBlock for the block's rows: packed where they fit in 8 (one decode token's GQA
// group), the same arguments otherwise. The single and the batched kernel pick alike.
template <int kD>
__device__ __forceinline__ void DecodeStreamRows(const WindowAttentionArgs& a, int64_t g,
                                                 int64_t row0, int64_t split,
                                                 int64_t slots_per_split, float* part_o,
                                                 float* part_lse, float* scores,
                                                 unsigned char* smem, unsigned* counter,
                                                 int64_t splits) {
  if (a.num_tokens * (a.num_q_heads / a.num_kv_heads) - row0 <= kRows / 2) {
    DecodeStreamBlock<kD, true>(a, g, row0, split, slots_per_split, part_o, part_lse, scores, smem,
                                counter, splits);
  } else {
    DecodeStreamBlock<kD, false>(a, g, row0, split, slots_per_split, part_o, part_lse, scores,
                                 smem, counter, splits);
  }
}

// grid [row_tiles, num_kv_heads, splits], kThreads threads: DecodeStreamBlock for row tile
// blockIdx.x, kv head blockIdx.y, split blockIdx.z.
// counters: null (a combine launch follows), or [row_tiles, num_kv_heads] zeroed counters of the
// fused split merge.
template <int kD>
__global__ void __launch_bounds__(kThreads)
    DecodeStreamKernel(WindowAttentionArgs a, int64_t slots_per_split, float* part_o,
                       float* part_lse, float* scores, unsigned* counters) {
  extern __shared__ __align__(128) unsigned char smem[];
  AllowDependentLaunch();  // the split combine may be scheduled now (it waits for us)
  unsigned* counter =
      counters != nullptr ? counters + blockIdx.x * a.num_kv_heads + blockIdx.y : nullptr;
  DecodeStreamRows<kD>(a, blockIdx.y, blockIdx.x * int64_t{kRows}, blockIdx.z, slots_per_split,
                       part_o, part_lse, scores, smem, counter, gridDim.z);
}

// grid [max_splits, num_kv_heads, count], kThreads threads: split blockIdx.x of kv head
// blockIdx.y of segment blockIdx.z (its one row tile); a block past its segment's split count
// exits at once. fused_merge: the split segments merge their states in the kernel (counters
// [count, num_kv_heads] at args.split_counters, the same for every segment).
template <int kD>
__global__ void __launch_bounds__(kThreads)
    DecodeStreamBatchKernel(const DecodeBatchSegment* segments, unsigned char* workspace,
                            bool fused_merge) {
  extern __shared__ __align__(128) unsigned char smem[];
  AllowDependentLaunch();  // the batched combine may be scheduled now (it waits for us)
  const DecodeBatchSegment& segment = segments[blockIdx.z];
  const int64_t splits = segment.splits;
  if (static_cast<int64_t>(blockIdx.x) >= splits) return;
  const WindowAttentionArgs a = segment.args;
  float* part_o = nullptr;
  float* part_lse = nullptr;
  if (splits > 1) {
    part_o = reinterpret_cast<float*>(workspace + segment.part_o_offset);
    part_lse = reinterpret_cast<float*>(workspace + segment.part_lse_offset);
  }
  unsigned* counter = fused_merge && splits > 1
                          ? a.split_counters + blockIdx.z * a.num_kv_heads + blockIdx.y
                          : nullptr;
  DecodeStreamRows<kD>(a, blockIdx.y, 0, blockIdx.x, segment.slots_per_split, part_o, part_lse,
                       nullptr, smem, counter, splits);
}

template <int kD>
cudaError_t Prepare() {
  return cudaFuncSetAttribute(DecodeStreamKernel<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(DecodeStage<kD>::kSmemBytes));
}

template <int kD>
cudaError_t Occupancy(int* blocks) {
  const cudaError_t error = Prepare<kD>();
  if (error != cudaSuccess) return error;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, DecodeStreamKernel<kD>, kThreads,
                                                       DecodeStage<kD>::kSmemBytes);
}

template <int kD>
cudaError_t Launch(const WindowAttentionArgs& a, dim3 grid, int64_t slots_per_split,
                   float* part_o, float* part_lse, float* scores, unsigned* counters,
                   cudaStream_t stream) {
  const cudaError_t error = Prepare<kD>();
  if (error != cudaSuccess) return error;
  DecodeStreamKernel<kD><<<grid, kThreads, DecodeStage<kD>::kSmemBytes, stream>>>(
      a, slots_per_split, part_o, part_lse, scores, counters);
  return cudaGetLastError();
}

template <int kD>
cudaError_t LaunchBatch(const DecodeBatchSegment* segments, dim3 grid, void* workspace,
                        bool fused_merge, cudaStream_t stream) {
  const cudaError_t error =
      cudaFuncSetAttribute(DecodeStreamBatchKernel<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(DecodeStage<kD>::kSmemBytes));
  if (error != cudaSuccess) return error;
  DecodeStreamBatchKernel<kD><<<grid, kThreads, DecodeStage<kD>::kSmemBytes, stream>>>(
      segments, static_cast<unsigned char*>(workspace), fused_merge);
  return cudaGetLastError();
}

}  // namespace

bool DecodeStreamSupports(const WindowAttentionArgs& a) {
  return a.cache_dtype == DType::kBF16 && a.head_dim <= 128;
}

cudaError_t DecodeStreamBlocksPerSm(const WindowAttentionArgs& a, int* blocks) {
  static std::atomic<int> cache[2] = {};  // per head-dim bucket; one architecture per process
  const int bucket = a.head_dim <= 64 ? 0 : 1;
  *blocks = cache[bucket].load(std::memory_order_relaxed);
  if (*blocks > 0) return cudaSuccess;
  const cudaError_t error = bucket == 0 ? Occupancy<64>(blocks) : Occupancy<128>(blocks);
  if (error != cudaSuccess) return error;
  cache[bucket].store(*blocks, std::memory_order_relaxed);
  return cudaSuccess;
}

unsigned* DecodeStreamMergeCounters(const WindowAttentionArgs& a, int64_t row_tiles,
                                    int64_t splits) {
  if (a.split_counters == nullptr || splits <= 1 || splits > kMaxFusedSplits) return nullptr;
  return row_tiles * a.num_kv_heads <= a.split_counter_count ? a.split_counters : nullptr;
}

cudaError_t LaunchDecodeStream(const WindowAttentionArgs& a, int64_t row_tiles, int64_t splits,
                               int64_t slots_per_split, float* part_o, float* part_lse,
                               float* scores, cudaStream_t stream) {
  if (!DecodeStreamSupports(a) || row_tiles <= 0 || splits <= 0 ||
      slots_per_split % kTile != 0) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(a.num_kv_heads),
                  static_cast<unsigned>(splits));
  auto launch = a.head_dim <= 64 ? Launch<64> : Launch<128>;
  unsigned* counters = part_o != nullptr ? DecodeStreamMergeCounters(a, row_tiles, splits) : nullptr;
  return launch(a, grid, slots_per_split, part_o, part_lse, scores, counters, stream);
}

cudaError_t LaunchDecodeStreamBatch(const DecodeBatchSegment* segments, int64_t count,
                                    int64_t max_splits, int64_t num_kv_heads, int64_t head_dim,
                                    void* workspace, bool fused_merge, cudaStream_t stream) {
  if (segments == nullptr || count <= 0 || count > 65535 || max_splits <= 0 ||
      num_kv_heads <= 0 || num_kv_heads > 65535 || head_dim > 128) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(max_splits), static_cast<unsigned>(num_kv_heads),
                  static_cast<unsigned>(count));
  auto launch = head_dim <= 64 ? LaunchBatch<64> : LaunchBatch<128>;
  return launch(segments, grid, workspace, fused_merge, stream);
}

}  // namespace tandem::gpu_worker::cuda_backend
