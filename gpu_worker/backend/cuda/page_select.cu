// SelectPages in two kernels on the backend's stream:
//
// 1. Scoring streams the summaries once: a page's min and max rows are read by kD / kVec lanes
//    with one 16-byte load each (a warp covers 32 / lanes pages per load, fully coalesced), the
//    lane keeps its chunk in registers and, for each query token of the block's token tile (q of
//    the tile's G heads in shared memory), sums max(q·min, q·max) over its chunk for the G heads;
//    a butterfly over the page's lanes completes the sums and the max over the heads is the
//    page's score, written to scratch [T, Hkv, num_pages]. Head dims and group sizes without a
//    specialisation take a one-warp-per-page kernel.
// 2. Top-k per (token, kv head) row: a radix select on the order-preserving uint32 key of the
//    scores (4 passes of 8 bits, shared-memory histograms with warp-aggregated atomics) finds the
//    key of the select-th best page and how many pages equal to it are kept; then the pages above
//    that key, and the first pages equal to it, are written in page order (counts, a scan for
//    the offsets), which makes the output ascending with the lowest ids winning ties. Few rows
//    (decode) run as a cooperative grid of many blocks per row, synchronised per radix pass, with
//    its histograms in the 64 KiB of scratch after the scores; many rows (prefill chunks) take
//    one block per row.
#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "device_utils.cuh"
#include "page_select.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kScoreWarps = 8;
constexpr int kScoreThreads = kScoreWarps * kWarpSize;
// Shared memory for the q tile of a scoring block (the default limit, no opt-in needed).
constexpr int64_t kMaxQTileBytes = 48 << 10;
// Page iterations per scoring warp at most (long contexts: fewer, fuller blocks).
constexpr int64_t kMaxScoreIters = 32;
// Page iterations whose summary loads a scoring warp issues together. NOTE: 2 took the bf16
// D 128 G 4 kernel from 39 to 63 registers and was 30% slower at 8K pages on an H100 (no gain at
// 64K): occupancy already keeps enough loads in flight.
constexpr int kLoadUnroll = 1;
constexpr int kFallbackWarps = 8;
constexpr int kRadixBits = 8;
constexpr int kBins = 1 << kRadixBits;
constexpr int kRadixPasses = 32 / kRadixBits;
constexpr int kGridTopThreads = 512;
// Global histogram buffers per row of the grid top-k: three, rotating, make one grid barrier per
// pass enough (a buffer is cleared two passes after it was read).
constexpr int kHistBuffers = 3;
// The scratch bytes after the scores (backend.h's SelectPagesScratchBytes: 64 KiB).
constexpr int64_t kSelectExtraScratchBytes = 64 << 10;

// Larger key = larger score (the IEEE order, -0 == +0; NaN with the sign bit clear above +inf);
// the cpu backend orders by the same key.
__device__ __forceinline__ uint32_t OrderKey(float score) {
  const uint32_t u = __float_as_uint(score == 0.0f ? 0.0f : score);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ int64_t MinI64(int64_t a, int64_t b) { return a < b ? a : b; }

template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

struct ScoreGrid {
  int64_t iters = 1;             // page iterations per warp
  int64_t tokens_per_block = 1;  // query tokens whose q a block holds in shared memory
};

// The score of a page from its lanes' partial sums: the sum of sums[j] over the kLanes lanes of
// the page (an xor butterfly) and the max over j, in every lane. Transposed: at each of the first
// log2(kGroup) levels a lane keeps half of its heads and sends the other half, so the kGroup
// sums take kGroup - 1 + log2(kLanes / kGroup) shuffles (plus log2(kGroup) for the max) instead
// of kGroup · log2(kLanes); every sum adds the same pairs as a plain butterfly, so the result is
// the same to the bit.
template <int kGroup, int kLanes>
__device__ __forceinline__ float PageScore(float (&sums)[kGroup], int lane) {
  static_assert(kGroup <= kLanes && (kGroup & (kGroup - 1)) == 0);
  int offset = kLanes / 2;
#pragma unroll
  for (int width = kGroup; width > 1; width /= 2) {
    const bool upper = (lane & offset) != 0;
#pragma unroll
    for (int k = 0; k < width / 2; ++k) {
      const float keep = upper ? sums[k + width / 2] : sums[k];
      const float send = upper ? sums[k] : sums[k + width / 2];
      sums[k] = keep + __shfl_xor_sync(kFullMask, send, offset);
    }
    offset /= 2;
  }
  float sum = sums[0];
#pragma unroll
  for (; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFullMask, sum, offset);
  // Lanes that differ in the first log2(kGroup) offsets hold the sums of the other heads.
#pragma unroll
  for (int o = kLanes / 2; o >= kLanes / kGroup; o /= 2) {
    sum = fmaxf(sum, __shfl_xor_sync(kFullMask, sum, o));
  }
  return sum;
}

// Grid: x = page blocks, y = kv head, z = token tiles. Dynamic shared memory: the q tile
// [tokens_per_block, kGroup, kHeadDim] f32.
template <typename T, int kHeadDim, int kGroup>
__device__ __forceinline__ void ScorePagesBlock(const SelectPagesArgs& args, ScoreGrid grid,
                                                int64_t page_block, int64_t g,
                                                int64_t token_tile) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kLanes = kHeadDim / kVec;  // lanes per page
  constexpr int kPagesPerWarp = kWarpSize / kLanes;
  static_assert(kHeadDim % kVec == 0 && kLanes <= kWarpSize && kWarpSize % kLanes == 0,
                "a page's min (or max) row must be 1..32 16-byte chunks, a power of two");
  static_assert(kVec % 4 == 0, "q chunks are read as float4");
  using P = Pack<T, kVec>;
  extern __shared__ float4 q_tile_raw[];
  float* q_tile = reinterpret_cast<float*>(q_tile_raw);

  const int64_t t0 = token_tile * grid.tokens_per_block;
  const int tokens = static_cast<int>(MinI64(grid.tokens_per_block, args.num_tokens - t0));
  for (int i = threadIdx.x; i < tokens * kGroup * kHeadDim; i += blockDim.x) {
    const int tt = i / (kGroup * kHeadDim);
    const int r = i % (kGroup * kHeadDim);
    q_tile[i] = args.q[(t0 + tt) * args.q_row_stride + g * (kGroup * kHeadDim) + r];
  }
  __syncthreads();

  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int sub = lane / kLanes;  // page of the warp's group
  const int d0 = (lane % kLanes) * kVec;
  const T* summaries = static_cast<const T*>(args.summaries) + g * args.max_pages * args.page_stride;
  const int64_t n = args.num_pages;
  float* scores = static_cast<float*>(args.scratch);
  const int64_t block_first = page_block * (grid.iters * kScoreWarps * kPagesPerWarp);
  for (int64_t it = 0; it < grid.iters; it += kLoadUnroll) {
    if (block_first + (it * kScoreWarps + warp) * kPagesPerWarp >= n) break;  // warp-uniform
    // The loads of kLoadUnroll iterations first: more bytes in flight per lane.
    int64_t page[kLoadUnroll];
    bool valid[kLoadUnroll];
    P lo_pack[kLoadUnroll], hi_pack[kLoadUnroll];
#pragma unroll
    for (int u = 0; u < kLoadUnroll; ++u) {
      page[u] = block_first + ((it + u) * kScoreWarps + warp) * kPagesPerWarp + sub;
      valid[u] = it + u < grid.iters && page[u] < n;
      lo_pack[u] = P{};
      hi_pack[u] = P{};
      if (valid[u]) {
        const T* row = summaries + page[u] * args.page_stride + d0;
        lo_pack[u] = *reinterpret_cast<const P*>(row);
        hi_pack[u] = *reinterpret_cast<const P*>(row + args.hi_offset);
      }
    }
#pragma unroll
    for (int u = 0; u < kLoadUnroll; ++u) {
      float lo[kVec], hi[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        lo[i] = ToFloat(lo_pack[u].v[i]);
        hi[i] = ToFloat(hi_pack[u].v[i]);
      }
      for (int tt = 0; tt < tokens; ++tt) {
        float sums[kGroup];
#pragma unroll
        for (int j = 0; j < kGroup; ++j) {
          const float* qj = q_tile + (tt * kGroup + j) * kHeadDim + d0;
          float sum = 0.0f;
#pragma unroll
          for (int i = 0; i < kVec; i += 4) {
            const float4 q4 = *reinterpret_cast<const float4*>(qj + i);
            sum += fmaxf(q4.x * lo[i], q4.x * hi[i]);
            sum += fmaxf(q4.y * lo[i + 1], q4.y * hi[i + 1]);
            sum += fmaxf(q4.z * lo[i + 2], q4.z * hi[i + 2]);
            sum += fmaxf(q4.w * lo[i + 3], q4.w * hi[i + 3]);
          }
          sums[j] = sum;
        }
        const float best = PageScore<kGroup, kLanes>(sums, lane);
        if (valid[u] && lane % kLanes == 0) {
          scores[((t0 + tt) * args.num_kv_heads + g) * n + page[u]] = best == 0.0f ? 0.0f : best;
        }
      }
    }
  }
}

template <typename T, int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kScoreThreads)
    ScorePagesKernel(SelectPagesArgs args, ScoreGrid grid) {
  ScorePagesBlock<T, kHeadDim, kGroup>(args, grid, blockIdx.x, blockIdx.y, blockIdx.z);
}

// The args of one batch entry: the shared shape with the entry's own fields.
__device__ __forceinline__ SelectPagesArgs EntryArgs(const SelectPagesArgs& shape,
                                                     const SelectPagesEntry& e) {
  SelectPagesArgs args = shape;
  args.q = e.q;
  args.q_row_stride = e.q_row_stride;
  args.summaries = e.summaries;
  args.max_pages = e.max_pages;
  args.num_pages = e.num_pages;
  args.select = e.select;
  args.pages = e.pages;
  args.keep = e.keep;
  args.keep_per_head = e.keep_per_head;
  args.scratch = e.scratch;
  return args;
}

// scores[row, id] = +inf for the ids of keep[row, :] in [0, n) (backend.h: kept pages outrank
// every other), by the block's threads.
__device__ __forceinline__ void MarkKeptPages(float* scores, int64_t n, const int32_t* keep,
                                              int64_t keep_per_head, int64_t row) {
  for (int64_t i = threadIdx.x; i < keep_per_head; i += blockDim.x) {
    const int32_t id = keep[row * keep_per_head + i];
    if (id >= 0 && id < n) scores[row * n + id] = __int_as_float(0x7f800000);
  }
}

// Grid: x = rows.
__global__ void KeepPagesKernel(float* scores, int64_t n, const int32_t* keep,
                                int64_t keep_per_head) {
  MarkKeptPages(scores, n, keep, keep_per_head, blockIdx.x);
}

// Batched: grid x = row, y = entry; entries without `keep` return at once.
__global__ void KeepPagesBatchKernel(const SelectPagesEntry* entries) {
  const SelectPagesEntry& e = entries[blockIdx.y];
  if (e.keep == nullptr) return;
  MarkKeptPages(static_cast<float*>(e.scratch), e.num_pages, e.keep, e.keep_per_head, blockIdx.x);
}

// Batched scoring, one token tile per entry. Grid: x = page blocks (of the longest entry),
// y = kv head, z = entry; blocks past an entry's pages return at once.
template <typename T, int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kScoreThreads)
    ScorePagesBatchKernel(SelectPagesArgs shape, const SelectPagesEntry* entries,
                          ScoreGrid grid) {
  const SelectPagesArgs args = EntryArgs(shape, entries[blockIdx.z]);
  constexpr int kPagesPerWarp = kWarpSize / (kHeadDim / (16 / sizeof(T)));
  if (blockIdx.x * (grid.iters * kScoreWarps * kPagesPerWarp) >= args.num_pages) return;
  ScorePagesBlock<T, kHeadDim, kGroup>(args, grid, blockIdx.x, blockIdx.y, 0);
}

// Any head_dim and group: one warp per page, lanes strided over d, every token in turn.
// Grid: x = page blocks of kFallbackWarps pages, y = kv head.
template <typename T>
__global__ void __launch_bounds__(kFallbackWarps * kWarpSize)
    ScorePagesFallbackKernel(SelectPagesArgs args) {
  const int64_t page = blockIdx.x * int64_t{kFallbackWarps} + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t n = args.num_pages;
  if (page >= n) return;  // warp-uniform
  const int64_t g = blockIdx.y;
  const int64_t d_count = args.head_dim;
  const int64_t group = args.num_q_heads / args.num_kv_heads;
  const T* lo =
      static_cast<const T*>(args.summaries) + (g * args.max_pages + page) * args.page_stride;
  const T* hi = lo + args.hi_offset;
  float* scores = static_cast<float*>(args.scratch);
  for (int64_t t = 0; t < args.num_tokens; ++t) {
    float best = 0.0f;
    for (int64_t j = 0; j < group; ++j) {
      const float* q = args.q + t * args.q_row_stride + (g * group + j) * d_count;
      float sum = 0.0f;
      for (int64_t d = lane; d < d_count; d += kWarpSize) {
        sum += fmaxf(q[d] * ToFloat(lo[d]), q[d] * ToFloat(hi[d]));
      }
      sum = WarpSum(sum);
      best = j == 0 ? sum : fmaxf(best, sum);
    }
    if (lane == 0) scores[(t * args.num_kv_heads + g) * n + page] = best == 0.0f ? 0.0f : best;
  }
}

// pages[row, i] = i for i < num_pages, else -1 (num_pages <= select: every page is kept).
__global__ void AllPagesKernel(int32_t* pages, int64_t rows, int64_t select, int64_t num_pages) {
  const int64_t count = rows * select;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < count;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = idx % select;
    pages[idx] = i < num_pages ? static_cast<int32_t>(i) : -1;
  }
}

// Warp 0 of a block: given the histogram of the current digit (at `shift`) over the candidates,
// picks the digit of the `remaining`-th best candidate and writes the extended prefix and how
// many of the best candidates remain among those with that digit.
__device__ __forceinline__ void ChooseDigit(const uint32_t* hist, uint32_t prefix,
                                            uint32_t remaining, int shift, int lane,
                                            uint32_t* chosen_prefix, uint32_t* chosen_remaining) {
  // Lane l holds bins kBins-1-l·kPer downwards: a scan over lanes is a scan over descending
  // digits.
  constexpr int kPer = kBins / kWarpSize;
  uint32_t local[kPer];
  uint32_t sum = 0;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    local[k] = hist[kBins - 1 - (lane * kPer + k)];
    sum += local[k];
  }
  uint32_t inclusive = sum;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset <<= 1) {
    const uint32_t up = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  const unsigned reached = __ballot_sync(kFullMask, inclusive >= remaining);
  if (lane == __ffs(reached) - 1) {
    uint32_t before = inclusive - sum;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      if (before + local[k] >= remaining) {
        const uint32_t digit = kBins - 1 - (lane * kPer + k);
        *chosen_prefix = prefix | (digit << shift);
        *chosen_remaining = remaining - before;
        break;
      }
      before += local[k];
    }
  }
}

// Adds the digits (at `shift`) of the keys in row[begin, end) that match `prefix` under `mask`
// to the shared histogram `hist`. Called by the whole block (block-uniform trip count).
__device__ __forceinline__ void AddToHistogram(const float* row, int64_t begin, int64_t end,
                                               uint32_t prefix, uint32_t mask, int shift,
                                               uint32_t* hist) {
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t base = begin; base < end; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    uint32_t digit = kBins;  // no bin
    if (i < end) {
      const uint32_t key = OrderKey(row[i]);
      if ((key & mask) == prefix) digit = (key >> shift) & (kBins - 1);
    }
    // NOTE: scores of a row mostly share their top bits; one atomic per distinct digit of the
    // warp keeps the first passes from serialising on one bin.
    const unsigned peers = __match_any_sync(kFullMask, digit);
    if (digit < kBins && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
  }
}

// One block per (token, kv head) row of scores [rows, n]: pages[row, :] = the `select` best pages
// (select < n), ascending.
template <int kThreads>
__device__ __forceinline__ void TopPagesRow(const float* scores, int64_t n, int64_t select,
                                            int32_t* pages, int64_t r) {
  static_assert(kThreads % kWarpSize == 0 && kBins % kWarpSize == 0);
  using Scan = cub::BlockScan<unsigned long long, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t chosen_prefix;
  __shared__ uint32_t chosen_remaining;
  const float* row = scores + r * n;
  int32_t* out = pages + r * select;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;

  // Radix select, most significant digit first: `prefix` (under `mask`) is the known part of the
  // select-th best key, `remaining` how many of the best pages have a key matching it.
  uint32_t prefix = 0;
  uint32_t mask = 0;
  uint32_t remaining = static_cast<uint32_t>(select);
  for (int pass = 0; pass < kRadixPasses; ++pass) {
    const int shift = 32 - kRadixBits * (pass + 1);
    for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
    __syncthreads();
    AddToHistogram(row, 0, n, prefix, mask, shift, hist);
    __syncthreads();
    if (warp == 0) {
      ChooseDigit(hist, prefix, remaining, shift, lane, &chosen_prefix, &chosen_remaining);
    }
    __syncthreads();
    prefix = chosen_prefix;
    remaining = chosen_remaining;
    mask |= static_cast<uint32_t>(kBins - 1) << shift;
  }

  // prefix is now the select-th best key; pages above it are all kept, and of the pages equal
  // to it the `remaining` lowest ids.
  const uint32_t threshold = prefix;
  const uint32_t keep_equal = remaining;
  const int64_t per_thread = (n + kThreads - 1) / kThreads;
  const int64_t begin = MinI64(n, threadIdx.x * per_thread);
  const int64_t end = MinI64(n, begin + per_thread);
  uint32_t above = 0, equal = 0;
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t key = OrderKey(row[i]);
    above += key > threshold;
    equal += key == threshold;
  }
  // (equal << 32) | above: both counts are < 2^31, so the halves never carry into each other.
  unsigned long long before = 0;
  Scan(scan_storage)
      .ExclusiveSum((static_cast<unsigned long long>(equal) << 32) | above, before);
  uint32_t above_before = static_cast<uint32_t>(before);
  uint32_t equal_before = static_cast<uint32_t>(before >> 32);
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t key = OrderKey(row[i]);
    if (key > threshold) {
      out[above_before + min(equal_before, keep_equal)] = static_cast<int32_t>(i);
      ++above_before;
    } else if (key == threshold) {
      if (equal_before < keep_equal) out[above_before + equal_before] = static_cast<int32_t>(i);
      ++equal_before;
    }
  }
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    TopPagesKernel(const float* scores, int64_t n, int64_t select, int32_t* pages) {
  TopPagesRow<kThreads>(scores, n, select, pages, blockIdx.x);
}

// Batched: grid x = row, y = entry.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    TopPagesBatchKernel(const SelectPagesEntry* entries) {
  const SelectPagesEntry& e = entries[blockIdx.y];
  TopPagesRow<kThreads>(static_cast<const float*>(e.scratch), e.num_pages, e.select, e.pages,
                        blockIdx.x);
}

// The same selection for few rows (decode: T·Hkv rows, fewer than the SMs): `chunks` blocks per
// row (grid: x = chunk, y = row; a cooperative launch, all blocks resident) each take a
// contiguous chunk of the row. Per radix pass the blocks add their shared histograms into the
// row's global one, the grid synchronises, and every block picks the same digit from it. Then
// each block counts its chunk's pages above / equal to the threshold, the grid synchronises,
// and each block writes its chunk's selected pages at the offset the earlier chunks' counts give,
// tile by tile in page order.
template <int kThreads>
__device__ __forceinline__ void TopPagesGridRow(const float* scores, int64_t n, int64_t select,
                                                int32_t* pages, uint32_t* global_hist,
                                                unsigned long long* chunk_counts,
                                                int64_t chunk_len, int64_t r) {
  // global_hist:  [rows, kHistBuffers, kBins]: pass p adds into buffer p % kHistBuffers
  // chunk_counts: [rows, chunks] (equal << 32) | above of each chunk
  namespace cg = cooperative_groups;
  cg::grid_group grid = cg::this_grid();
  using Scan = cub::BlockScan<unsigned long long, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t chosen_prefix;
  __shared__ uint32_t chosen_remaining;
  const int chunk = blockIdx.x;
  const int chunks = gridDim.x;
  const float* row = scores + r * n;
  int32_t* out = pages + r * select;
  uint32_t* row_hist = global_hist + r * (kHistBuffers * kBins);
  const int64_t begin = MinI64(n, chunk * chunk_len);
  const int64_t end = MinI64(n, begin + chunk_len);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;

  if (chunk == 0) {
    for (int i = threadIdx.x; i < kBins; i += kThreads) row_hist[i] = 0;
  }
  grid.sync();
  uint32_t prefix = 0;
  uint32_t mask = 0;
  uint32_t remaining = static_cast<uint32_t>(select);
  for (int pass = 0; pass < kRadixPasses; ++pass) {
    const int shift = 32 - kRadixBits * (pass + 1);
    for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
    __syncthreads();
    AddToHistogram(row, begin, end, prefix, mask, shift, hist);
    __syncthreads();
    uint32_t* pass_hist = row_hist + (pass % kHistBuffers) * kBins;
    for (int i = threadIdx.x; i < kBins; i += kThreads) {
      if (hist[i] != 0) atomicAdd(&pass_hist[i], hist[i]);
    }
    // The next pass's buffer was last read (ChooseDigit of pass - 2) before the previous grid
    // barrier, and is next written after the coming one.
    if (chunk == 0 && pass + 1 < kRadixPasses) {
      uint32_t* next = row_hist + ((pass + 1) % kHistBuffers) * kBins;
      for (int i = threadIdx.x; i < kBins; i += kThreads) next[i] = 0;
    }
    grid.sync();
    if (warp == 0) {
      ChooseDigit(pass_hist, prefix, remaining, shift, lane, &chosen_prefix, &chosen_remaining);
    }
    __syncthreads();
    prefix = chosen_prefix;
    remaining = chosen_remaining;
    mask |= static_cast<uint32_t>(kBins - 1) << shift;
  }
  const uint32_t threshold = prefix;
  const uint32_t keep_equal = remaining;

  // (equal << 32) | above: both counts are < 2^31, so the halves never carry into each other.
  unsigned long long counts = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const uint32_t key = OrderKey(row[i]);
    counts += (static_cast<unsigned long long>(key == threshold) << 32) | (key > threshold);
  }
  unsigned long long ignored = 0, total = 0;
  Scan(scan_storage).ExclusiveSum(counts, ignored, total);
  if (threadIdx.x == 0) chunk_counts[r * chunks + chunk] = total;
  grid.sync();
  // The counts of the chunks before this one (chunks <= kThreads).
  __syncthreads();
  unsigned long long running = 0;
  Scan(scan_storage)
      .ExclusiveSum(threadIdx.x < chunk ? chunk_counts[r * chunks + threadIdx.x] : 0ull, ignored,
                    running);
  for (int64_t tile = begin; tile < end; tile += kThreads) {  // block-uniform trip count
    const int64_t i = tile + threadIdx.x;
    const uint32_t key = i < end ? OrderKey(row[i]) : 0u;
    const bool above = i < end && key > threshold;
    const bool equal = i < end && key == threshold;
    unsigned long long before = 0, tile_total = 0;
    __syncthreads();  // scan_storage is reused
    Scan(scan_storage)
        .ExclusiveSum((static_cast<unsigned long long>(equal) << 32) | above, before, tile_total);
    before += running;
    const uint32_t above_before = static_cast<uint32_t>(before);
    const uint32_t equal_before = static_cast<uint32_t>(before >> 32);
    if (above) {
      out[above_before + min(equal_before, keep_equal)] = static_cast<int32_t>(i);
    } else if (equal && equal_before < keep_equal) {
      out[above_before + equal_before] = static_cast<int32_t>(i);
    }
    running += tile_total;
  }
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    TopPagesGridKernel(const float* scores, int64_t n, int64_t select, int32_t* pages,
                       uint32_t* global_hist, unsigned long long* chunk_counts,
                       int64_t chunk_len) {
  TopPagesGridRow<kThreads>(scores, n, select, pages, global_hist, chunk_counts, chunk_len,
                            blockIdx.y);
}

// Batched: grid x = chunk, y = row, z = entry (a cooperative launch over all entries; every
// entry has the same rows, so every block takes part in every grid barrier).
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    TopPagesGridBatchKernel(const SelectPagesEntry* entries) {
  const SelectPagesEntry& e = entries[blockIdx.z];
  TopPagesGridRow<kThreads>(static_cast<const float*>(e.scratch), e.num_pages, e.select, e.pages,
                            e.hist, e.chunk_counts, e.chunk_len, blockIdx.y);
}

template <typename T, int kHeadDim, int kGroup>
cudaError_t LaunchScore(const SelectPagesArgs& args, cudaStream_t stream) {
  constexpr int kPagesPerWarp = kWarpSize / (kHeadDim / (16 / sizeof(T)));
  constexpr int64_t kTokenBytes = int64_t{kGroup} * kHeadDim * sizeof(float);
  static_assert(kTokenBytes <= kMaxQTileBytes);
  ScoreGrid grid;
  grid.tokens_per_block = std::min<int64_t>(args.num_tokens, kMaxQTileBytes / kTokenBytes);
  const int64_t token_tiles = (args.num_tokens + grid.tokens_per_block - 1) / grid.tokens_per_block;
  // Enough warps for two full waves of the device; the rest as iterations of each warp (fewer
  // q tile loads per summary byte).
  const int64_t warp_tasks = (args.num_pages + kPagesPerWarp - 1) / kPagesPerWarp;
  const int64_t target_warps = std::max<int64_t>(
      1, int64_t{args.num_sms} * 2 * 2048 / kWarpSize / (args.num_kv_heads * token_tiles));
  grid.iters = std::clamp<int64_t>(warp_tasks / target_warps, 1, kMaxScoreIters);
  const int64_t pages_per_block = grid.iters * kScoreWarps * kPagesPerWarp;
  const dim3 blocks(static_cast<unsigned>((args.num_pages + pages_per_block - 1) / pages_per_block),
                    static_cast<unsigned>(args.num_kv_heads), static_cast<unsigned>(token_tiles));
  const size_t smem = static_cast<size_t>(grid.tokens_per_block * kTokenBytes);
  ScorePagesKernel<T, kHeadDim, kGroup><<<blocks, kScoreThreads, smem, stream>>>(args, grid);
  return cudaGetLastError();
}

template <typename T, int kHeadDim>
bool TryScoreGroup(const SelectPagesArgs& args, cudaStream_t stream, cudaError_t* error) {
  switch (args.num_q_heads / args.num_kv_heads) {
    case 1:
      *error = LaunchScore<T, kHeadDim, 1>(args, stream);
      return true;
    case 2:
      *error = LaunchScore<T, kHeadDim, 2>(args, stream);
      return true;
    case 4:
      *error = LaunchScore<T, kHeadDim, 4>(args, stream);
      return true;
    case 8:
      *error = LaunchScore<T, kHeadDim, 8>(args, stream);
      return true;
    default:
      return false;
  }
}

template <typename T>
cudaError_t LaunchScoreTyped(const SelectPagesArgs& args, cudaStream_t stream) {
  cudaError_t error = cudaSuccess;
  if (reinterpret_cast<uintptr_t>(args.summaries) % 16 == 0) {
    if (args.head_dim == 64 && TryScoreGroup<T, 64>(args, stream, &error)) return error;
    if (args.head_dim == 128 && TryScoreGroup<T, 128>(args, stream, &error)) return error;
  }
  const dim3 blocks(static_cast<unsigned>((args.num_pages + kFallbackWarps - 1) / kFallbackWarps),
                    static_cast<unsigned>(args.num_kv_heads));
  ScorePagesFallbackKernel<T><<<blocks, kFallbackWarps * kWarpSize, 0, stream>>>(args);
  return cudaGetLastError();
}

template <typename T, int kHeadDim, int kGroup>
cudaError_t LaunchScoreBatch(const SelectPagesBatchPlan& plan, const SelectPagesEntry* entries,
                             cudaStream_t stream) {
  constexpr int kPagesPerWarp = kWarpSize / (kHeadDim / (16 / sizeof(T)));
  constexpr int64_t kTokenBytes = int64_t{kGroup} * kHeadDim * sizeof(float);
  const SelectPagesArgs& shape = plan.shape;
  ScoreGrid grid;
  grid.tokens_per_block = shape.num_tokens;   // one tile (SelectPagesBatchable)
  // LaunchScore's sizing over the pages of all entries (the scores do not depend on it).
  const int64_t warp_tasks = (plan.total_pages + kPagesPerWarp - 1) / kPagesPerWarp;
  const int64_t target_warps =
      std::max<int64_t>(1, int64_t{shape.num_sms} * 2 * 2048 / kWarpSize / shape.num_kv_heads);
  grid.iters = std::clamp<int64_t>(warp_tasks / target_warps, 1, kMaxScoreIters);
  const int64_t pages_per_block = grid.iters * kScoreWarps * kPagesPerWarp;
  const dim3 blocks(static_cast<unsigned>((plan.longest + pages_per_block - 1) / pages_per_block),
                    static_cast<unsigned>(shape.num_kv_heads), static_cast<unsigned>(plan.count));
  const size_t smem = static_cast<size_t>(grid.tokens_per_block * kTokenBytes);
  ScorePagesBatchKernel<T, kHeadDim, kGroup>
      <<<blocks, kScoreThreads, smem, stream>>>(shape, entries, grid);
  return cudaGetLastError();
}

template <typename T, int kHeadDim>
cudaError_t LaunchScoreBatchGroup(const SelectPagesBatchPlan& plan,
                                  const SelectPagesEntry* entries, cudaStream_t stream) {
  switch (plan.shape.num_q_heads / plan.shape.num_kv_heads) {
    case 1: return LaunchScoreBatch<T, kHeadDim, 1>(plan, entries, stream);
    case 2: return LaunchScoreBatch<T, kHeadDim, 2>(plan, entries, stream);
    case 4: return LaunchScoreBatch<T, kHeadDim, 4>(plan, entries, stream);
    case 8: return LaunchScoreBatch<T, kHeadDim, 8>(plan, entries, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t LaunchScoreBatchTyped(const SelectPagesBatchPlan& plan,
                                  const SelectPagesEntry* entries, cudaStream_t stream) {
  if (plan.shape.head_dim == 64) return LaunchScoreBatchGroup<T, 64>(plan, entries, stream);
  if (plan.shape.head_dim == 128) return LaunchScoreBatchGroup<T, 128>(plan, entries, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchScorePages(const SelectPagesArgs& args, cudaStream_t stream) {
  if (args.num_tokens <= 0 || args.num_kv_heads <= 0 || args.num_pages <= 0) return cudaSuccess;
  switch (args.dtype) {
    case DType::kF32:
      return LaunchScoreTyped<float>(args, stream);
    case DType::kBF16:
      return LaunchScoreTyped<__nv_bfloat16>(args, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchTopPages(const SelectPagesArgs& args, cudaStream_t stream) {
  const int64_t rows = args.num_tokens * args.num_kv_heads;
  const int64_t n = args.num_pages;
  if (rows <= 0 || args.select <= 0 || n <= args.select) return cudaSuccess;
  const float* scores = static_cast<const float*>(args.scratch);
  if (rows < args.num_sms) {
    // Few rows: several blocks per row, as many as can be resident at once (a cooperative
    // launch), their histograms and chunk counts in the scratch after the scores.
    constexpr int kThreads = kGridTopThreads;
    int per_sm = 0;
    const cudaError_t error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, TopPagesGridKernel<kThreads>, kThreads, 0);
    if (error != cudaSuccess) return error;
    const uintptr_t scores_end =
        reinterpret_cast<uintptr_t>(args.scratch) + static_cast<uintptr_t>(rows * n) * 4;
    const uintptr_t workspace = (scores_end + 255) / 256 * 256;
    const int64_t hist_bytes = rows * kHistBuffers * kBins * 4;
    const int64_t free_bytes =
        kSelectExtraScratchBytes - static_cast<int64_t>(workspace - scores_end) - hist_bytes;
    const int64_t chunks =
        std::min({int64_t{per_sm} * args.num_sms / rows, (n + kThreads - 1) / kThreads,
                  int64_t{kThreads}, free_bytes / (rows * 8)});
    if (chunks >= 2) {
      int64_t chunk_len = (n + chunks - 1) / chunks;
      uint32_t* hist = reinterpret_cast<uint32_t*>(workspace);
      unsigned long long* chunk_counts = reinterpret_cast<unsigned long long*>(workspace + hist_bytes);
      int64_t num_pages = n;
      int64_t select = args.select;
      int32_t* pages = args.pages;
      void* params[] = {&scores, &num_pages, &select, &pages, &hist, &chunk_counts, &chunk_len};
      const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(rows));
      return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(TopPagesGridKernel<kThreads>),
                                         grid, kThreads, params, 0, stream);
    }
  }
  if (n >= 8192) {
    TopPagesKernel<1024><<<static_cast<unsigned>(rows), 1024, 0, stream>>>(
        scores, n, args.select, args.pages);
  } else {
    TopPagesKernel<256><<<static_cast<unsigned>(rows), 256, 0, stream>>>(
        scores, n, args.select, args.pages);
  }
  return cudaGetLastError();
}

cudaError_t LaunchSelectPages(const SelectPagesArgs& args, cudaStream_t stream) {
  const int64_t rows = args.num_tokens * args.num_kv_heads;
  if (rows <= 0 || args.select <= 0 || args.num_pages <= 0) return cudaSuccess;
  if (args.num_pages > args.select) {
    const cudaError_t error = LaunchScorePages(args, stream);
    if (error != cudaSuccess) return error;
  }
  return LaunchSelectFromScores(args, stream);
}

cudaError_t LaunchSelectFromScores(const SelectPagesArgs& args, cudaStream_t stream) {
  const int64_t rows = args.num_tokens * args.num_kv_heads;
  if (rows <= 0 || args.select <= 0 || args.num_pages <= 0) return cudaSuccess;
  if (args.num_pages <= args.select) {
    constexpr int kThreads = 256;
    AllPagesKernel<<<GridStrideBlocks(rows * args.select, kThreads), kThreads, 0, stream>>>(
        args.pages, rows, args.select, args.num_pages);
    return cudaGetLastError();
  }
  if (args.keep != nullptr && args.keep_per_head > 0) {
    KeepPagesKernel<<<static_cast<unsigned>(rows), 128, 0, stream>>>(
        static_cast<float*>(args.scratch), args.num_pages, args.keep, args.keep_per_head);
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  return LaunchTopPages(args, stream);
}

}  // namespace tandem::gpu_worker::cuda_backend

namespace tandem::gpu_worker::cuda_backend {

bool SelectPagesBatchable(const SelectPagesArgs& args) {
  if (args.dtype != DType::kF32 && args.dtype != DType::kBF16) return false;
  if (args.num_pages <= args.select || args.num_tokens <= 0) return false;
  if (args.head_dim != 64 && args.head_dim != 128) return false;
  if (reinterpret_cast<uintptr_t>(args.summaries) % 16 != 0) return false;
  const int64_t group = args.num_q_heads / args.num_kv_heads;
  if (group != 1 && group != 2 && group != 4 && group != 8) return false;
  const int64_t token_bytes = group * args.head_dim * int64_t{sizeof(float)};
  return args.num_tokens <= kMaxQTileBytes / token_bytes;
}

cudaError_t PlanSelectPagesBatch(const SelectPagesArgs& shape, SelectPagesEntry* entries,
                                 int64_t count, SelectPagesBatchPlan* plan) {
  *plan = SelectPagesBatchPlan{.shape = shape, .count = count};
  const int64_t rows = shape.num_tokens * shape.num_kv_heads;
  int64_t free_bytes = INT64_MAX;
  for (int64_t i = 0; i < count; ++i) {
    SelectPagesEntry& e = entries[i];
    plan->any_keep = plan->any_keep || (e.keep != nullptr && e.keep_per_head > 0);
    plan->longest = std::max(plan->longest, e.num_pages);
    plan->total_pages += e.num_pages;
    // LaunchTopPages's layout: histograms then chunk counts, after the scores.
    const uintptr_t scores_end =
        reinterpret_cast<uintptr_t>(e.scratch) + static_cast<uintptr_t>(rows * e.num_pages) * 4;
    const uintptr_t workspace = (scores_end + 255) / 256 * 256;
    const int64_t hist_bytes = rows * kHistBuffers * kBins * 4;
    e.hist = reinterpret_cast<uint32_t*>(workspace);
    e.chunk_counts = reinterpret_cast<unsigned long long*>(workspace + hist_bytes);
    free_bytes = std::min(free_bytes, kSelectExtraScratchBytes -
                                          static_cast<int64_t>(workspace - scores_end) -
                                          hist_bytes);
  }
  constexpr int kThreads = kGridTopThreads;
  int per_sm = 0;
  const cudaError_t error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, TopPagesGridBatchKernel<kThreads>, kThreads, 0);
  if (error != cudaSuccess) return error;
  const int64_t chunks =
      std::min({int64_t{per_sm} * shape.num_sms / (rows * count),
                (plan->longest + kThreads - 1) / kThreads, int64_t{kThreads},
                free_bytes / (rows * 8)});
  plan->chunks = chunks >= 2 ? chunks : 0;
  for (int64_t i = 0; plan->chunks != 0 && i < count; ++i) {
    entries[i].chunk_len = (entries[i].num_pages + plan->chunks - 1) / plan->chunks;
  }
  return cudaSuccess;
}

cudaError_t LaunchSelectPagesBatch(const SelectPagesBatchPlan& plan,
                                   const SelectPagesEntry* entries, cudaStream_t stream) {
  if (plan.count <= 0) return cudaSuccess;
  cudaError_t error = cudaSuccess;
  switch (plan.shape.dtype) {
    case DType::kF32:
      error = LaunchScoreBatchTyped<float>(plan, entries, stream);
      break;
    case DType::kBF16:
      error = LaunchScoreBatchTyped<__nv_bfloat16>(plan, entries, stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  if (error != cudaSuccess) return error;
  const int64_t rows = plan.shape.num_tokens * plan.shape.num_kv_heads;
  if (plan.any_keep) {
    KeepPagesBatchKernel<<<dim3(static_cast<unsigned>(rows), static_cast<unsigned>(plan.count)),
                           128, 0, stream>>>(entries);
    error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  if (plan.chunks != 0) {
    constexpr int kThreads = kGridTopThreads;
    void* params[] = {&entries};
    const dim3 grid(static_cast<unsigned>(plan.chunks), static_cast<unsigned>(rows),
                    static_cast<unsigned>(plan.count));
    return cudaLaunchCooperativeKernel(
        reinterpret_cast<const void*>(TopPagesGridBatchKernel<kThreads>), grid, kThreads, params,
        0, stream);
  }
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(plan.count));
  if (plan.longest >= 8192) {
    TopPagesBatchKernel<1024><<<grid, 1024, 0, stream>>>(entries);
  } else {
    TopPagesBatchKernel<256><<<grid, 256, 0, stream>>>(entries);
  }
  return cudaGetLastError();
}

}  // namespace tandem::gpu_worker::cuda_backend
