// The Hopper window attention kernel (window_attention_hopper.cuh): wgmma m64n128k16 with bf16 q
// and p, f32 accumulation, 128 query rows and 128-slot K/V tiles per block.
#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "device_utils.cuh"
#include "hopper_device.cuh"
#include "mma_utils.cuh"
#include "window_attention_hopper.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kD = 128;               // head_dim
constexpr int kRows = 128;            // query rows per block: two warpgroups of 64
constexpr int kTile = 128;            // slots per K/V tile
constexpr int kSummaryTile = 64;      // slots per entry of the position summary (kMmaSlotTile)
constexpr int kComputeThreads = 256;  // warps 0-7: two warpgroups
// Warpgroup 2 (warps 8-11) loads the K/V tiles; it needs few registers, so they move to the
// computing warpgroups (setmaxnreg).
constexpr int kLoadThreads = 128;
constexpr int kThreads = kComputeThreads + kLoadThreads;
constexpr int kLoaderRegisters = 56;
constexpr int kComputeRegisters = 224;  // (65536 - 128·56) / 256, a multiple of 8
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kChunks = kD / 8;                       // 16-byte chunks per row
constexpr int kLoadRowStep = kLoadThreads / kChunks;  // rows the loaders copy per step (8)
static_assert(kLoadThreads == kTile, "each loading thread fetches one row's slot position");
constexpr int kMatrixBytes = kTile * kD * 2;   // one bf16 tile: 32 KiB
constexpr int kStageBytes = 2 * kMatrixBytes;  // K then V
// Stages: tile j + 1 loading, j in S = Q·Kᵀ, j - 1's V read by P·V.
constexpr int kStages = 3;
constexpr int kQBytes = kRows * kD * 2;
constexpr int kPosBytes = kTile * 4;
// Q, the K/V stages, their slot positions, and slack to align the start to 1024 bytes.
constexpr size_t kSmemBytes = kQBytes + kStages * (kStageBytes + kPosBytes) + 1024;
// Named barriers: 0 __syncthreads, 1 the loaders, 2 and 3 the computing warpgroups' turns, 4
// the staged query.
constexpr int kQueryBarrier = 4;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
static_assert(kRows == kTile, "Q and K/V tiles share TileOffset<128>");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
using hopper::KMajorDescriptor;
using hopper::MnMajorDescriptor;
using hopper::TileOffset;

// Warpgroups 0-1 stage the block's 128 query rows as bf16 q · scale·log2e in shared memory
// (TileOffset<128> layout; zero past T·G): 8 of the 2048 16-byte chunks per thread, all 16 loads
// issued before the first is used, while the loading warpgroup fetches the first K/V tiles.
__device__ __forceinline__ void StageScaledQuery(const WindowAttentionArgs& a, int row0, int g,
                                                 int group, int rows, float scale_log2,
                                                 __nv_bfloat16* qs) {
  constexpr int kPerThread = kRows * kChunks / kComputeThreads;
  float4 x[kPerThread][2];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int i = threadIdx.x + k * kComputeThreads;
    const int row = row0 + i / kChunks;
    x[k][0] = x[k][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (row < rows) {
      const float* src = a.q + (row / group) * a.q_row_stride +
                         (g * group + row % group) * kD + (i % kChunks) * 8;
      x[k][0] = *reinterpret_cast<const float4*>(src);
      x[k][1] = *reinterpret_cast<const float4*>(src + 4);
    }
  }
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int i = threadIdx.x + k * kComputeThreads;
    const float4 lo = x[k][0];
    const float4 hi = x[k][1];
    uint4 packed;
    packed.x = Bits(__floats2bfloat162_rn(lo.x * scale_log2, lo.y * scale_log2));
    packed.y = Bits(__floats2bfloat162_rn(lo.z * scale_log2, lo.w * scale_log2));
    packed.z = Bits(__floats2bfloat162_rn(hi.x * scale_log2, hi.y * scale_log2));
    packed.w = Bits(__floats2bfloat162_rn(hi.z * scale_log2, hi.w * scale_log2));
    *reinterpret_cast<uint4*>(qs + TileOffset<kRows>(i / kChunks, i % kChunks)) = packed;
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// grid [row_tiles, num_kv_heads, splits], 384 threads. Warpgroup wg < 2 owns the block's rows
// 64·wg .. + 63; warp w of it rows 16w + lane/4 and + 8 (the accumulator layout). Warpgroup 2
// loads: per tile it waits for the stage to be free, copies K and V (TMA boxes of k_map / v_map;
// tiles with empty slots by cp.async, thread i: chunk i % 16 of rows i / 16 + 8r) and the slot
// positions, and the stage is full when they have landed (tiles with empty slots: after the
// loaders zeroed their V rows). The computing warpgroups take ping-pong turns issuing their
// products: per tile S = Q·Kᵀ and the previous tile's O += P·V are issued together, then the
// mask, the online softmax (log2 units: q carries scale·log2e), and p̃ = bf16(p) into P's
// registers; a stage is marked free once both warpgroups' P·V of it completed.
__global__ void __launch_bounds__(kThreads, 1)
    HopperAttentionKernel(WindowAttentionArgs a, const __grid_constant__ CUtensorMap k_map,
                          const __grid_constant__ CUtensorMap v_map, int64_t slots_per_split,
                          const int32_t* tile_min, const int32_t* tile_max, float* part_o,
                          float* part_lse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  __shared__ int red[4][kWarps];
  // full: the 128 loading threads arrive (and a whole tile's TMA bytes land)
  __shared__ __align__(8) uint64_t full[kStages];
  __shared__ __align__(8) uint64_t empty[kStages];  // the 8 computing warps arrive
  AllowDependentLaunch();  // the split combine may be scheduled now (it waits for us)

  const uint32_t raw_addr = SmemAddr(smem_raw);
  unsigned char* smem = smem_raw + (((raw_addr + 1023) & ~1023u) - raw_addr);
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem);
  auto keys_of = [&](int stage) {
    return reinterpret_cast<__nv_bfloat16*>(smem + kQBytes + stage * kStageBytes);
  };
  auto positions_of = [&](int stage) {
    return reinterpret_cast<int*>(smem + kQBytes + kStages * kStageBytes + stage * kPosBytes);
  };
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  // Warp-uniform as the compiler sees it (a shuffle), so wgmma's register handling needs no
  // serialisation for divergent paths.
  const bool loader = __shfl_sync(kFullMask, threadIdx.x / 128, 0) == 2;
  const int wg = warp / 4;
  // 32-bit row and slot indices: T·G and num_slots are far below 2^31 (the backend's checks).
  const int g = blockIdx.y;
  const int row0 = (gridDim.x - 1 - blockIdx.x) * kRows;  // latest rows first
  const int split = blockIdx.z;
  const int group = static_cast<int>(a.num_q_heads / a.num_kv_heads);
  const int rows = static_cast<int>(a.num_tokens) * group;
  const float scale_log2 = a.scale * kLog2e;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      hopper::BarrierInit(&full[i], kLoadThreads);
      hopper::BarrierInit(&empty[i], kComputeThreads / kWarpSize);
    }
  }

  // This thread's rows (a and b = a + 8) and the block's position range (the loading warpgroup
  // has no rows).
  const int row_a = row0 + wg * 64 + (warp % 4) * 16 + lane / 4;
  const int qpos_a = !loader && row_a < rows ? a.q_pos[row_a / group] : -1;  // -1: sees nothing
  const int qpos_b = !loader && row_a + 8 < rows ? a.q_pos[(row_a + 8) / group] : -1;
  int max_q = __reduce_max_sync(kFullMask, max(qpos_a, qpos_b));
  // -1 with padding rows
  int min_q = __reduce_min_sync(kFullMask, loader ? INT_MAX : min(qpos_a, qpos_b));
  if (lane == 0) {
    red[0][warp] = max_q;
    red[1][warp] = min_q;
  }
  __syncthreads();  // also publishes the barriers' initialisation
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    max_q = max(max_q, red[0][w]);
    min_q = min(min_q, red[1][w]);
  }

  // The 128-slot tiles of this split that hold a position some row of the block can see; tile
  // j covers summary entries 2j and 2j + 1 (the second absent past the split's end).
  const int s_begin = split * static_cast<int>(slots_per_split);
  const int s_end = static_cast<int>(min(a.num_slots, int64_t{s_begin} + slots_per_split));
  const int summary_begin = s_begin / kSummaryTile;
  const int tiles = (s_end - s_begin + kTile - 1) / kTile;
  auto has_second_half = [&](int j) { return s_begin + j * kTile + kSummaryTile < s_end; };
  int first = INT_MAX, last = -1;
  for (int j = threadIdx.x; j < tiles; j += kThreads) {
    int lo = tile_min[summary_begin + 2 * j];
    if (has_second_half(j)) lo = min(lo, tile_min[summary_begin + 2 * j + 1]);
    if (lo <= max_q) {
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

  if (loader) {
    hopper::SetMaxRegisters<kLoaderRegisters, false>();
    if (first > last) return;
    if (threadIdx.x == kComputeThreads) {
      hopper::PrefetchTensorMap(&k_map);
      hopper::PrefetchTensorMap(&v_map);
    }
    const __nv_bfloat16* k_head =
        static_cast<const __nv_bfloat16*>(a.k_cache) + g * a.capacity * kD;
    const __nv_bfloat16* v_head =
        static_cast<const __nv_bfloat16*>(a.v_cache) + g * a.capacity * kD;
    const int tid = threadIdx.x - kComputeThreads;
    const int chunk = tid % kChunks;
    for (int i = 0; i <= last - first; ++i) {
      const int j = first + i;
      const int stage = i % kStages;
      if (i >= kStages) hopper::BarrierWait(&empty[stage], (i / kStages - 1) & 1);
      __nv_bfloat16* ks = keys_of(stage);
      __nv_bfloat16* vs = ks + kTile * kD;
      int* spos = positions_of(stage);
      const int tile_slot = s_begin + j * kTile;
      // A tile whose 128 slots all hold a position (the summary's max is finite for both
      // halves) needs no fix-up: the tensor memory accelerator copies K and V (two 64-column
      // boxes each, issued by one thread, their bytes counted on the stage's full barrier) and
      // each thread its slot's position by cp.async, whose landing is its arrival on the
      // barrier. So the loaders never wait for their copies and keep the next stages' in flight.
      const int t = summary_begin + 2 * j;
      const bool whole = has_second_half(j) && tile_max[t] != INT_MAX && tile_max[t + 1] != INT_MAX;
      if (whole) {
        if (tid == 0) {
          hopper::BarrierExpectBytes(&full[stage], kStageBytes);
          hopper::TmaLoad3d(&k_map, ks, &full[stage], 0, tile_slot, g);
          hopper::TmaLoad3d(&k_map, ks + kTile * 64, &full[stage], 64, tile_slot, g);
          hopper::TmaLoad3d(&v_map, vs, &full[stage], 0, tile_slot, g);
          hopper::TmaLoad3d(&v_map, vs + kTile * 64, &full[stage], 64, tile_slot, g);
        }
        CpAsync4(SmemAddr(spos + tid), a.slot_pos + tile_slot + tid, true);
        CpAsyncCommit();
        hopper::CpAsyncArriveOnBarrier(&full[stage]);
        continue;
      }
      // Otherwise the loaders copy by cp.async (slots past the split's end as zeros), wait for
      // the copies (each thread's, then a barrier of the loaders for each other's), zero this
      // thread's row of V if its slot is empty, record its position, and publish to the async
      // proxy.
#pragma unroll 4
      for (int r = tid / kChunks; r < kTile; r += kLoadRowStep) {
        const int slot = tile_slot + r;
        const bool in = slot < s_end;
        const int64_t offset = int64_t{in ? slot : s_begin} * kD + chunk * 8;
        CpAsync16(SmemAddr(ks + TileOffset<kTile>(r, chunk)), k_head + offset, in);
        CpAsync16(SmemAddr(vs + TileOffset<kTile>(r, chunk)), v_head + offset, in);
      }
      CpAsyncCommit();
      const int pos = tile_slot + tid < s_end ? a.slot_pos[tile_slot + tid] : -1;
      CpAsyncWait<0>();
      hopper::NamedBarrierSync(1, kLoadThreads);
      spos[tid] = pos;
      // NOTE: an empty slot's V row may be unwritten memory (NaN); its weight is 0, but
      // 0·NaN = NaN in the product, so the row is zeroed.
      if (pos < 0) {
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          *reinterpret_cast<uint4*>(vs + TileOffset<kTile>(tid, c)) = make_uint4(0, 0, 0, 0);
        }
      }
      hopper::FenceSharedForWgmma();
      hopper::BarrierArrive(&full[stage]);
    }
    return;
  }

  hopper::SetMaxRegisters<kComputeRegisters, true>();
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;
  float m_a = -INFINITY, m_b = -INFINITY;  // running max of the log2-unit scores
  // This lane's share of Σ p, the f32 weights: summing them rather than their bf16 roundings
  // p̃ (which O multiplies) saves 64 conversions per tile and thread (+5% on the H200), and the
  // lse is the exact one (its error against the exact kernel halved; o's did not move).
  float l_a = 0.0f, l_b = 0.0f;

  if (first <= last) {
    StageScaledQuery(a, row0, g, group, rows, scale_log2, qs);
    hopper::FenceSharedForWgmma();
    hopper::NamedBarrierSync(kQueryBarrier, kComputeThreads);
    const uint32_t q_addr = SmemAddr(qs) + wg * 64 * 128;  // this warpgroup's 64 rows
    // P of the previous tile as bf16 A fragments ([n-tile][row a, row b]); its P·V is issued
    // with the next tile's Q·Kᵀ, so the tensor cores run it while this warpgroup does softmax.
    uint32_t p[kTile / 8][2] = {};  // tile 0's "previous" P·V adds 0 (V finite: zeroed rows)
    // O += P·V for the tile in `stage`: P's fragment for slots 16kk .. + 15 is S's n-tiles 2kk
    // and 2kk + 1; V's 16 rows of those slots start 16 rows (2048 bytes) further per step.
    auto issue_pv = [&](int stage) {
      const uint32_t v_addr = SmemAddr(keys_of(stage) + kTile * kD);
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        const uint32_t frag[4] = {p[2 * kk][0], p[2 * kk][1], p[2 * kk + 1][0], p[2 * kk + 1][1]};
        hopper::WgmmaRegisterShared(o, frag, MnMajorDescriptor<kTile>(v_addr + kk * 16 * 128));
      }
      hopper::WgmmaCommit();
    };
    // Ping-pong (FlashAttention-3): the warpgroups take turns issuing their products, so one's
    // softmax runs while the tensor cores work on the other's products. Named barrier 2 + w
    // (256 threads: warpgroup w waits, the other arrives) is warpgroup w's turn; 0 starts.
    auto take_turn = [&] { hopper::NamedBarrierSync(2 + wg, kComputeThreads); };
    auto pass_turn = [&] { hopper::NamedBarrierArrive(2 + (1 - wg), kComputeThreads); };
    if (wg == 1) pass_turn();
    for (int i = 0; i <= last - first; ++i) {
      const int j = first + i;
      const int stage = i % kStages;
      const int* spos = positions_of(stage);
      // The loaders' writes are acquired through the barrier: TMA's are async-proxy writes
      // already, and the loaders fence their generic-proxy ones (cp.async copies, zeroed rows)
      // before they arrive, so the wgmma reads need no fence here.
      hopper::BarrierWait(&full[stage], (i / kStages) & 1);
      take_turn();
      // Every slot of the tile holds a position every row of the block sees: no mask.
      const int t = summary_begin + 2 * j;
      const bool unmasked = has_second_half(j) && max(tile_max[t], tile_max[t + 1]) <= min_q;

      // S = Q·Kᵀ: 8 steps of 16 dims; dims 64.. in the tiles' second halves. Then the previous
      // tile's P·V; wait for S only.
      float s[64];
      const uint32_t k_addr = SmemAddr(keys_of(stage));
      hopper::WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        const uint32_t step = (kk / 4) * hopper::kHalfBytes<kRows> + (kk % 4) * 32;
        hopper::WgmmaSharedShared(s, KMajorDescriptor(q_addr + step),
                                  KMajorDescriptor(k_addr + step), kk > 0);
      }
      hopper::WgmmaCommit();
      issue_pv(i > 0 ? (i - 1) % kStages : 0);  // tile 0: its own stage with P = 0
      pass_turn();
      hopper::WgmmaWait<1>();
      hopper::PinRegisters(s);

      // Mask by position (s[4n], s[4n + 1] row a, s[4n + 2], s[4n + 3] row b, slots
      // 8n + 2(lane % 4) + {0, 1}) and the online softmax; p in place of s.
      if (!unmasked) {
#pragma unroll
        for (int n = 0; n < kTile / 8; ++n) {
          const int2 sp = *reinterpret_cast<const int2*>(spos + n * 8 + 2 * (lane & 3));
          s[4 * n + 0] = (sp.x >= 0 && sp.x <= qpos_a) ? s[4 * n + 0] : -INFINITY;
          s[4 * n + 1] = (sp.y >= 0 && sp.y <= qpos_a) ? s[4 * n + 1] : -INFINITY;
          s[4 * n + 2] = (sp.x >= 0 && sp.x <= qpos_b) ? s[4 * n + 2] : -INFINITY;
          s[4 * n + 3] = (sp.y >= 0 && sp.y <= qpos_b) ? s[4 * n + 3] : -INFINITY;
        }
      }
      float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
      for (int n = 0; n < kTile / 8; ++n) {
        mx_a = fmaxf(mx_a, fmaxf(s[4 * n + 0], s[4 * n + 1]));
        mx_b = fmaxf(mx_b, fmaxf(s[4 * n + 2], s[4 * n + 3]));
      }
      const auto [base_a, base_b, corr_a, corr_b] = OnlineSoftmaxStep(mx_a, mx_b, &m_a, &m_b);
#pragma unroll
      for (int n = 0; n < kTile / 8; ++n) {
        s[4 * n + 0] = Exp2(s[4 * n + 0] - base_a);
        s[4 * n + 1] = Exp2(s[4 * n + 1] - base_a);
        s[4 * n + 2] = Exp2(s[4 * n + 2] - base_b);
        s[4 * n + 3] = Exp2(s[4 * n + 3] - base_b);
      }
      // l moves to the new max and adds the tile's f32 weights while P·V may still run.
      l_a *= corr_a;
      l_b *= corr_b;
#pragma unroll
      for (int n = 0; n < kTile / 8; ++n) {
        l_a += s[4 * n + 0] + s[4 * n + 1];
        l_b += s[4 * n + 2] + s[4 * n + 3];
      }

      // The previous P·V is done: its stage is free, O and P's registers too. O moves to the new
      // max; p̃ = bf16(p) into P's fragments.
      hopper::WgmmaWait<0>();
      hopper::PinRegisters(o);
      hopper::PinRegisters(p);
      if (i > 0 && lane == 0) hopper::BarrierArrive(&empty[(i - 1) % kStages]);
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        o[4 * n + 0] *= corr_a;
        o[4 * n + 1] *= corr_a;
        o[4 * n + 2] *= corr_b;
        o[4 * n + 3] *= corr_b;
      }
#pragma unroll
      for (int n = 0; n < kTile / 8; ++n) {
        const __nv_bfloat162 pa = __floats2bfloat162_rn(s[4 * n + 0], s[4 * n + 1]);
        const __nv_bfloat162 pb = __floats2bfloat162_rn(s[4 * n + 2], s[4 * n + 3]);
        p[n][0] = Bits(pa);
        p[n][1] = Bits(pb);
      }
    }
    // The last tile's P·V (warpgroup 1's last turn is passed to no one: each barrier has as
    // many arrivals as waits).
    take_turn();
    hopper::WgmmaFence();
    issue_pv((last - first) % kStages);
    if (wg == 0) pass_turn();
    hopper::WgmmaWait<0>();
    hopper::PinRegisters(o);
  }

  // Epilogue: l summed over the 4 lanes of a row; o = O / l, lse = (m + log2 l)·ln2.
  l_a += __shfl_xor_sync(kFullMask, l_a, 1);
  l_a += __shfl_xor_sync(kFullMask, l_a, 2);
  l_b += __shfl_xor_sync(kFullMask, l_b, 1);
  l_b += __shfl_xor_sync(kFullMask, l_b, 2);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row_a + 8 * half;
    if (row >= rows) continue;
    const float m = half == 0 ? m_a : m_b;
    const float l = half == 0 ? l_a : l_b;
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
    for (int n = 0; n < kD / 8; ++n) {
      const int col = n * 8 + 2 * (lane & 3);
      *reinterpret_cast<float2*>(dst_o + dst_row * kD + col) =
          make_float2(o[4 * n + 2 * half] * inv, o[4 * n + 2 * half + 1] * inv);
    }
    if ((lane & 3) == 0) dst_lse[dst_row] = lse;
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// The driver's cuTensorMapEncodeTiled, through the runtime (no link to libcuda); null when the
// driver lacks it.
PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// The TMA view of one layer's K or V cache [num_kv_heads][capacity][128] bf16: boxes of 64
// columns x 128 slots of one head, 128-byte swizzled (one half of a TileOffset<128> tile).
cudaError_t EncodeCacheMap(const void* cache, int64_t capacity, int64_t num_kv_heads,
                           CUtensorMap* map) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {kD, static_cast<cuuint64_t>(capacity),
                              static_cast<cuuint64_t>(num_kv_heads)};
  const cuuint64_t strides[2] = {kD * 2, static_cast<cuuint64_t>(capacity) * kD * 2};  // bytes
  const cuuint32_t box[3] = {64, kTile, 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult result =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(cache), dims, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace

bool HopperAttentionSupports(const WindowAttentionArgs& a) {
  // TMA needs 16-byte aligned caches; q is read as float4.
  return a.cache_dtype == DType::kBF16 && a.head_dim == kD && a.maw == nullptr &&
         a.num_kv_heads > 0 && a.q_row_stride % 4 == 0 &&
         reinterpret_cast<uintptr_t>(a.q) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(a.k_cache) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(a.v_cache) % 16 == 0;
}

bool HopperAttentionAvailable() {
  // One architecture per process (as the occupancy caches assume): asked once. The driver must
  // also encode tensor maps (the TMA loads).
  static const bool available = [] {
    int device = 0, major = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      return false;
    }
    return major == 9 && TensorMapEncoder() != nullptr;
  }();
  return available;
}

cudaError_t LaunchHopperAttention(const WindowAttentionArgs& a, int64_t row_tiles, int64_t splits,
                                  int64_t slots_per_split, const int32_t* tile_min,
                                  const int32_t* tile_max, float* part_o, float* part_lse,
                                  cudaStream_t stream) {
  if (!HopperAttentionSupports(a) || tile_min == nullptr || tile_max == nullptr ||
      slots_per_split % kSummaryTile != 0 || row_tiles <= 0 || splits <= 0 || a.num_slots <= 0) {
    return cudaErrorInvalidValue;
  }
  if (!HopperAttentionAvailable()) return cudaErrorNotSupported;
  CUtensorMap k_map, v_map;
  cudaError_t error = EncodeCacheMap(a.k_cache, a.capacity, a.num_kv_heads, &k_map);
  if (error == cudaSuccess) error = EncodeCacheMap(a.v_cache, a.capacity, a.num_kv_heads, &v_map);
  if (error != cudaSuccess) return error;
  static const cudaError_t prepared =
      cudaFuncSetAttribute(HopperAttentionKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kSmemBytes));
  if (prepared != cudaSuccess) return prepared;
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(a.num_kv_heads),
                  static_cast<unsigned>(splits));
  HopperAttentionKernel<<<grid, kThreads, kSmemBytes, stream>>>(
      a, k_map, v_map, slots_per_split, tile_min, tile_max, part_o, part_lse);
  return cudaGetLastError();
}

}  // namespace tandem::gpu_worker::cuda_backend
