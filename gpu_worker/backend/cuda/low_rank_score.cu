// The kLowRank page scores on the GPU (low_rank_score.cuh; the keys' coordinates come from
// key_projection.cu).
//
// The scoring kernel streams each head's coordinate rows once (rank 64: 64 int8 codes and an f32
// scale, 68 bytes a key). A block owns one kv head and a tile of query columns c = (t, j): its
// prologue computes q̃ of those columns (f32 in d order, the basis staged 32 rows at a time),
// scales each column by a power of two to integers of at most 22 bits and stores them as three
// signed int8 limbs in the B-fragment layout of mma.m16n8k32.s8. Each warp streams its steps of 16
// coordinate rows (32 when two tiles share an n-tile, below) through a ring of 3-4 steps in shared
// memory filled by cp.async (16-byte copies, a step's 16·rank bytes contiguous; chunks swizzled
// so one ldmatrix.x4 per k-step gives the A fragment without bank conflicts), so 2-3 steps are in
// flight per warp while one is scored. Scoring a step: the int8 mmas give exact int32 sums per
// limb (hi and mid combined as hi·256 + mid, at most 2^29, and lo), converted and recombined in
// f32, times the column's power of two and σ·scale of the key: x[key, column]. The page's
// logsumexp takes the max, then the sum of expf(x - max), over the page's 16 rows with
// transposed xor-shuffle reductions (the 8 row lanes of a C fragment are lanes 4 apart; a lane
// keeps half of its values at each level), pages of 32 rows or more merge their steps'
// (max, sum), pages of 1-8 rows reduce over fewer lane levels. The max over a token's heads is a
// shuffle over the lanes holding its columns (the group is padded to a power of two of at most 8
// columns, so a token's columns never straddle an n-tile). 1-4 columns (decode of one token at
// group 4, say) put two 16-row tiles in one n-tile: tile i is multiplied with B columns
// 4i..4i+3 (zeros elsewhere), so no padding column reaches the epilogue; 5-8, 9-16 and 17-32
// columns take one, two and four n-tiles, more columns several column tiles (grid z).
// The grid is one wave: the resident blocks are shared out among the (kv head, column tile)
// pairs, each block taking a contiguous range of units (steps, or pages of several steps), its
// warps interleaved.
//
// NOTE: the epilogue (about 25 instructions per key and column: the limb combination, expf and
// the reductions) bounds the kernel past ~4 columns per key; at rank 64 on an H200 it reads
// ~2.9 TB/s at 1 token of group 4 and ~1.8 TB/s at 4 tokens (16 columns).
//
// Other ranks, group sizes over 8, page sizes neither dividing nor multiples of 16 and unaligned
// coordinates take a generic kernel: one thread per (page, token), f32 dot products in r order,
// an online logsumexp.
#include <cfloat>
#include <cstdint>

#include "device_utils.cuh"
#include "low_rank_score.cuh"
#include "mma_utils.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kScoreWarps = 8;
constexpr int kScoreThreads = kScoreWarps * kWarpSize;
constexpr int kTileRows = 16;  // coordinate rows of an mma tile (its M)
constexpr int kLimbs = 3;
constexpr int kQTildeBits = 22;  // |q̃ integer| <= 2^22: three 8-bit limbs, exact int32 sums

constexpr int kGenericThreads = 256;
constexpr int kGenericQTildeFloats = static_cast<int>(kLowRankMaxRank);

// ---------------------------------------------------------------------------------------------
// kLowRank scores, tensor-core kernel.

struct ScoreGrid {
  int64_t iters = 1;             // units per warp at most
  int64_t tokens_per_block = 1;  // query tokens of a block's column tile
  int gp_shift = 0;              // log2 of the columns per token (the group rounded up)
  int page_shift = 0;            // log2(page_tokens) for pages of at most 16 rows
};

// c[16x8] += a[16x32] · b[32x8]: int8 operands in the mma.sync fragment layouts (a: the four
// registers ldmatrix gives), exact int32 sums.
__device__ __forceinline__ void MmaS8(int (&c)[4], const uint32_t (&a)[4], uint2 b) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
}

// The lanes that share lane % 4 (the 8 rows gi of a C fragment, lanes 4 apart) reduce kV values
// each with `op`, transposed: at each of the first log2(kV) levels a lane keeps half of its values
// and sends the other half, so the kV reductions take kV - 1 shuffles plus one per level left
// (a plain butterfly takes 3·kV). Returns the reduction of value HeldIndex<kV>(lane).
template <int kV, typename Op>
__device__ __forceinline__ float TransposedReduce(float (&vals)[kV], int lane, Op op) {
  int offset = 4;
#pragma unroll
  for (int width = kV; width > 1; width /= 2) {
    const bool upper = (lane & offset) != 0;
#pragma unroll
    for (int k = 0; k < width / 2; ++k) {
      const float keep = upper ? vals[k + width / 2] : vals[k];
      const float send = upper ? vals[k] : vals[k + width / 2];
      vals[k] = op(keep, __shfl_xor_sync(kFullMask, send, offset));
    }
    offset *= 2;
  }
#pragma unroll
  for (; offset < kWarpSize; offset *= 2)
    vals[0] = op(vals[0], __shfl_xor_sync(kFullMask, vals[0], offset));
  return vals[0];
}

// The value index TransposedReduce leaves in `lane`: lane bits 2, 3, 4 (the levels that halved
// the values) as the index's bits from the top.
template <int kV>
__device__ __forceinline__ int HeldIndex(int lane) {
  const int b0 = (lane >> 2) & 1, b1 = (lane >> 3) & 1, b2 = (lane >> 4) & 1;
  if constexpr (kV == 2) return b0;
  if constexpr (kV == 4) return 2 * b0 + b1;
  return 4 * b0 + 2 * b1 + b2;
}

// A lane with the same lane % 4 that holds value index v after TransposedReduce.
template <int kV>
__device__ __forceinline__ int HolderOf(int lane, int v) {
  if constexpr (kV == 2) return (lane & ~4) | (v << 2);
  if constexpr (kV == 4) return (lane & ~12) | ((v >> 1) << 2) | ((v & 1) << 3);
  return (lane & 3) | ((v >> 2) << 2) | (((v >> 1) & 1) << 3) | ((v & 1) << 4);
}

__device__ __forceinline__ float Max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ float Add(float a, float b) { return a + b; }

// One step: kPack tiles of 16 coordinate rows and their scales, staged in shared memory by
// cp.async: codes [kPack·16][kRank] then scales [kPack·16]. The 16-byte chunks of a row are
// XOR-swizzled (chunk c of row r at c ^ Swizzle(r)) so that the 8 rows one ldmatrix phase reads
// fall in 8 distinct bank groups. Rows past the end are zero-filled (a zero scale, which reaches
// no written page). The per-lane shared-memory offsets are computed once (the constructor).
template <int kRank, int kPack>
struct StepIo {
  static constexpr int kRows = 16 * kPack;
  static constexpr int kCodeBytes = kRows * kRank;
  static constexpr int kBytes = kCodeBytes + kRows * 4;
  static constexpr int kStages = kBytes <= 2048 ? 4 : 3;  // steps in a warp's ring
  static constexpr int kChunksPerRow = kRank / 16;
  static constexpr int kCopies = kCodeBytes / 16 / kWarpSize;  // 16-byte copies per lane
  static constexpr int kKSteps = kRank / 32;
  static_assert(kCodeBytes % (16 * kWarpSize) == 0);

  // The 8 rows one ldmatrix phase reads (rows r..r+7, r a multiple of 8) differ in
  // r / (8 / kChunksPerRow) mod kChunksPerRow: XORed into the chunk index, their 16-byte chunks
  // fall in 8 distinct bank groups.
  static __device__ __forceinline__ int Swizzle(int row) {
    return (row / (8 / kChunksPerRow)) % kChunksPerRow;
  }

  int copy_dst[kCopies];  // lane's 16-byte copy k: its chunk k·32 + lane, swizzled
  int copy_row[kCopies];  // and that chunk's row
  int ld_src[kKSteps];    // ldmatrix row address of k-step s (tile 0)
  int scale_src;          // the scale of row gi of the thread's tile

  __device__ __forceinline__ explicit StepIo(int lane) {
#pragma unroll
    for (int k = 0; k < kCopies; ++k) {
      const int chunk = k * kWarpSize + lane;
      copy_row[k] = chunk / kChunksPerRow;
      copy_dst[k] = copy_row[k] * kRank + ((chunk % kChunksPerRow) ^ Swizzle(copy_row[k])) * 16;
    }
    // ldmatrix.x4: lane l addresses matrix l / 8: rows (l / 8 % 2)·8 + l % 8, chunk 2s + l / 16,
    // which gives each lane its A fragment (rows gi and gi + 8, bytes 32s + 4q.. and +16).
    const int row = (lane / 8 % 2) * 8 + lane % 8;
#pragma unroll
    for (int s = 0; s < kKSteps; ++s) {
      ld_src[s] = row * kRank + (((2 * s + lane / 16) ^ Swizzle(row)) * 16);
    }
    const int tile = kPack == 1 ? 0 : (lane % 4) / 2;
    scale_src = kCodeBytes + (tile * 16 + lane / 4) * 4;
  }

  // The lane's copies of a step whose first `left` rows exist (src: the lane's 16-byte chunk of
  // the step's first row, its scales) into the stage at shared address `dst`.
  __device__ __forceinline__ void Issue(uint32_t dst, const int8_t* src_codes,
                                        const float* src_scales, int left, int lane) const {
#pragma unroll
    for (int k = 0; k < kCopies; ++k) {
      CpAsync16(dst + copy_dst[k], src_codes + k * kWarpSize * 16, copy_row[k] < left);
    }
    if (lane < kRows) CpAsync4(dst + kCodeBytes + lane * 4, src_scales, lane < left);
  }
};

// The A fragments of a step (a[i][s]: tile i, k-step s; rank bytes [32s, 32s + 32)) and the
// scales of rows gi and gi + 8 of the thread's own tile (the tile its C columns belong to).
template <int kRank, int kPack>
struct StepRows {
  uint32_t a[kPack][kRank / 32][4];
  float scale[2];

  __device__ __forceinline__ void Read(const StepIo<kRank, kPack>& io, uint32_t stage_addr,
                                       const uint8_t* stage) {
#pragma unroll
    for (int i = 0; i < kPack; ++i) {
#pragma unroll
      for (int s = 0; s < kRank / 32; ++s) {
        LdMatrixX4(stage_addr + i * 16 * kRank + io.ld_src[s], a[i][s]);
      }
    }
    scale[0] = *reinterpret_cast<const float*>(stage + io.scale_src);
    scale[1] = *reinterpret_cast<const float*>(stage + io.scale_src + 32);
  }
};

// Grid: x = unit blocks, y = kv head, z = column (token) tiles.
//
// Columns: a block scores kCols q̃ columns c = tt·gp + j (gp = 2^gp_shift columns per token,
// j >= group padding). kNT n-tiles of 8 columns each (kPack = 1), or, for 4 columns or fewer,
// kPack = 2 tiles of 16 rows at once in one n-tile: tile i is multiplied with a B holding the
// columns at n = 4i..4i+3 and zeros elsewhere, so the C fragment's columns 0-3 are tile 0's rows
// and 4-7 tile 1's (no padding column reaches the epilogue).
//
// Pages: page_tokens >= 16 (a multiple of 16; kPack = 1, or 16 with kPack = 2): the tile's 16
// rows belong to one page; the max and the sum over them are transposed reductions over the 8
// row lanes, and pages of several tiles merge their tiles' (max, sum). page_tokens of 1, 2, 4 or
// 8: the rows gi and gi + 8 belong to different pages, reduced over log2(page_tokens) lane levels.
template <int kRank, int kNT, int kPack>
__global__ void __launch_bounds__(kScoreThreads, 2)
    LowRankScoresMmaKernel(LowRankScoreArgs args, ScoreGrid grid) {
  static_assert(kRank % 32 == 0 && kRank <= 128 && (kNT == 1 || kPack == 1) && kPack <= 2);
  constexpr int kSteps = kRank / 32;   // k-steps of the mma
  constexpr int kSlots = kNT * kPack;  // B fragments per k-step and limb
  constexpr int kCols = kNT * 8 / kPack;
  constexpr int kV = 2 * kNT;  // C values per thread and row: (n-tile, column pair)
  constexpr int kStepRows = 16 * kPack;
  constexpr int kChunk = 32;  // d rows of the basis staged at a time
  constexpr int kColGroups = kScoreThreads / kRank;
  constexpr int kPerThread = (kCols + kColGroups - 1) / kColGroups;
  // B fragments: [slot][k-step][limb][lane] {b0, b1}: the limbs of column n = lane / 4 at ranks
  // 32·step + 4q..4q+3 (b0) and 32·step + 16 + 4q..+3 (b1), q = lane % 4.
  __shared__ uint2 b_frag[kSlots][kSteps][kLimbs][kWarpSize];
  __shared__ float col_scale[kCols];  // 2^-shift of each column; 0 for a padding column
  __shared__ union {
    struct {
      float basis[kChunk][kRank];
      float q[kCols][kChunk];
    } stage;
    float q_tilde[kCols][kRank];
  } smem;

  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t g = blockIdx.y;
  const int group = static_cast<int>(args.num_q_heads / args.num_kv_heads);
  const int gp_mask = (1 << grid.gp_shift) - 1;
  const int64_t t0 = int64_t{blockIdx.z} * grid.tokens_per_block;
  const int tokens = static_cast<int>(min(grid.tokens_per_block, args.num_tokens - t0));
  const int64_t d_count = args.head_dim;
  const int64_t page_tokens = args.page_tokens;
  const int64_t rows_total = args.num_pages * page_tokens;
  const bool tile_pages = page_tokens >= 16;  // a tile lies in one page
  const int64_t unit_rows = tile_pages && page_tokens > kStepRows ? page_tokens : kStepRows;
  const int steps_per_unit = static_cast<int>(unit_rows / kStepRows);
  const int64_t units = (rows_total + unit_rows - 1) / unit_rows;
  const int8_t* head_codes = args.coords + g * args.max_tokens * kRank;
  const float* head_scales = args.scales + g * args.max_tokens;

  // The warp's units: first_unit + it·kScoreWarps for it < its_count, steps_per_unit steps each,
  // streamed through the warp's ring of kStages steps (kStages - 1 in flight).
  using Io = StepIo<kRank, kPack>;
  constexpr int kStages = Io::kStages;
  const int64_t first_unit = int64_t{blockIdx.x} * grid.iters * kScoreWarps + warp;
  const int64_t its_count =
      first_unit >= units ? 0
                          : min(grid.iters, (units - first_unit + kScoreWarps - 1) / kScoreWarps);
  extern __shared__ uint4 ring_raw[];  // [kScoreWarps][kStages][Io::kBytes]
  const uint8_t* ring = reinterpret_cast<const uint8_t*>(ring_raw) + warp * kStages * Io::kBytes;
  const uint32_t ring_addr = SmemAddr(ring);
  const Io io(lane);
  // The next step to copy: its first row (a unit's steps are consecutive rows, units
  // kScoreWarps·unit_rows apart), the lane's sources, and the steps left of the warp's.
  int64_t issue_row = first_unit * unit_rows;
  const int8_t* issue_codes = head_codes + issue_row * kRank + lane * 16;
  const float* issue_scales = head_scales + issue_row + lane;
  int64_t issue_left = its_count * steps_per_unit;
  int issue_step = 0;
  const int64_t unit_jump = kScoreWarps * unit_rows - (steps_per_unit - 1) * kStepRows;
  auto issue = [&](int slot) {  // the next step's copies (or an empty group past the end)
    if (issue_left > 0) {
      const int64_t rows_left = rows_total - issue_row;
      io.Issue(ring_addr + slot * Io::kBytes, issue_codes, issue_scales,
               rows_left >= kStepRows ? kStepRows : static_cast<int>(rows_left), lane);
      --issue_left;
      int64_t jump = kStepRows;
      if (++issue_step == steps_per_unit) {
        issue_step = 0;
        jump = unit_jump;
      }
      issue_row += jump;
      issue_codes += jump * kRank;
      issue_scales += jump;
    }
    CpAsyncCommit();
  };
  // The first steps' copies fly while the block computes q̃.
#pragma unroll
  for (int slot = 0; slot < kStages - 1; ++slot) issue(slot);

  for (int i = threadIdx.x; i < kSlots * kSteps * kLimbs * kWarpSize; i += kScoreThreads) {
    (&b_frag[0][0][0][0])[i] = uint2{0, 0};
  }
  // q̃[c, r] = Σ_d q[t0 + c >> gp_shift, g·group + (c & gp_mask), d]·basis[g, d, r] (zero for
  // padding columns): f32 fused multiply-adds in d order, kChunk rows of the basis and of q
  // staged in shared memory at a time.
  {
    const int r = threadIdx.x % kRank;
    const int c0 = threadIdx.x / kRank;
    float acc[kPerThread] = {};
    const float* basis = args.basis + g * d_count * kRank;
    for (int64_t d0 = 0; d0 < d_count; d0 += kChunk) {
      __syncthreads();  // the previous chunk is consumed
      for (int i = threadIdx.x; i < kChunk * kRank; i += kScoreThreads) {
        const int64_t d = d0 + i / kRank;
        (&smem.stage.basis[0][0])[i] = d < d_count ? __ldg(basis + d0 * kRank + i) : 0.0f;
      }
      for (int i = threadIdx.x; i < kCols * kChunk; i += kScoreThreads) {
        const int c = i / kChunk;
        const int64_t d = d0 + i % kChunk;
        const int tt = c >> grid.gp_shift;
        const int j = c & gp_mask;
        const bool used = tt < tokens && j < group && d < d_count;
        smem.stage.q[c][i % kChunk] =
            used ? __ldg(args.q + (t0 + tt) * args.q_row_stride + (g * group + j) * d_count + d)
                 : 0.0f;
      }
      __syncthreads();
#pragma unroll 8
      for (int dd = 0; dd < kChunk; ++dd) {
        const float b = smem.stage.basis[dd][r];
#pragma unroll
        for (int k = 0; k < kPerThread; ++k) {
          const int c = c0 + k * kColGroups;
          if (c < kCols) acc[k] = fmaf(smem.stage.q[c][dd], b, acc[k]);
        }
      }
    }
    __syncthreads();  // the staging area becomes q_tilde
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int c = c0 + k * kColGroups;
      if (c < kCols) smem.q_tilde[c][r] = acc[k];
    }
  }
  __syncthreads();

  // Limbs: x = rint(q̃·2^shift) with |x| <= 2^22 (shift from the column's largest |q̃_r|),
  // x = hi·2^16 + mid·2^8 + lo with signed 8-bit limbs, stored in every slot that holds column c.
  for (int c = warp; c < kCols; c += kScoreWarps) {
    float amax = 0.0f;
    for (int r = lane; r < kRank; r += kWarpSize) amax = fmaxf(amax, fabsf(smem.q_tilde[c][r]));
    amax = WarpMax(amax);
    const bool usable = amax > 0.0f && amax <= FLT_MAX;
    int exponent = 0;
    if (usable) frexpf(amax, &exponent);  // amax < 2^exponent
    const int shift = kQTildeBits - exponent;
    for (int r = lane; r < kRank; r += kWarpSize) {
      const int x = usable ? __float2int_rn(ldexpf(smem.q_tilde[c][r], shift)) : 0;
      const int lo = ((x + 128) & 255) - 128;
      const int x1 = (x - lo) >> 8;
      const int mid = ((x1 + 128) & 255) - 128;
      const int hi = (x1 - mid) >> 8;
      // Rank r is k = r % 32 of k-step r / 32: b0 holds k = 4q..4q+3 and b1 k = 16 + 4q..+3
      // of the lane with q = lane % 4 (the rows ldmatrix gives the A side).
      const int k = r % 32;
      const int q = (k % 16) / 4;
      const int byte = (k / 16) * 4 + k % 4;
#pragma unroll
      for (int i = 0; i < kPack; ++i) {
        const int slot = kPack == 1 ? c / 8 : i;
        const int n = kPack == 1 ? c % 8 : 4 * i + c;
        int8_t* dst = reinterpret_cast<int8_t*>(&b_frag[slot][r / 32][0][n * 4 + q]) + byte;
        constexpr int kLimbStride = kWarpSize * sizeof(uint2);
        dst[0] = static_cast<int8_t>(hi);
        dst[kLimbStride] = static_cast<int8_t>(mid);
        dst[2 * kLimbStride] = static_cast<int8_t>(lo);
      }
    }
    if (lane == 0) col_scale[c] = usable ? ldexpf(1.0f, -shift) : 0.0f;
  }
  __syncthreads();
  if (its_count == 0) return;

  const int gi = lane / 4;                   // C fragment rows gi and gi + 8
  const int qi = lane % 4;                   // C fragment columns 2qi, 2qi + 1
  const int tile = kPack == 1 ? 0 : qi / 2;  // the tile of this thread's C columns
  const int gp = 1 << grid.gp_shift;
  const float sigma = args.softmax_scale;
  const float inv_sigma = 1.0f / sigma;                             // the contract's 1/σ
  const int64_t token_stride = args.num_kv_heads * args.num_pages;  // floats between tokens
  float* scores = args.scores + t0 * token_stride + g * args.num_pages;
  // The q̃ column of C value v = 2·nt + c (n-tile nt, column 2qi + c of the fragment), and its
  // scale 2^-shift (cs) and 256·cs.
  auto column = [qi](int v) {
    return kPack == 1 ? (v / 2) * 8 + 2 * qi + v % 2 : (2 * qi + v % 2) % 4;
  };
  float cs[kV], cs256[kV];
#pragma unroll
  for (int v = 0; v < kV; ++v) {
    cs[v] = col_scale[column(v)];
    cs256[v] = 256.0f * cs[v];
  }

  // Pages of 16 rows or more: the C value the lane holds after the reductions, whether it is a
  // padding column, and whether the lane writes its token's score (the token's first column;
  // replica lanes, gi >= kV, stay silent) and where.
  const int held_col = column(HeldIndex<kV>(lane));
  const bool held_padding = (held_col & gp_mask) >= group;
  const bool held_writer =
      gi < kV && (held_col & gp_mask) == 0 && (held_col >> grid.gp_shift) < tokens;
  float* held_scores = scores + (held_col >> grid.gp_shift) * token_stride;
  float run_max = 0.0f, run_sum = 0.0f;  // pages of several steps: the merged (max, sum)
  // Scores one step: `unit` and `step` say which rows (row0) and pages.
  auto process = [&](const StepRows<kRank, kPack>& cur, int64_t unit, int step) {
    const int64_t row0 = unit * unit_rows + step * kStepRows;
    // x[h][v] = σ·scale·(q̃·code) of row gi + 8h of the thread's tile and C value v: the limbs'
    // exact sums, hi·256 + mid and lo converted to f32 and combined.
    float x[2][kV];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      int hi[4] = {}, mid[4] = {}, lo[4] = {};
#pragma unroll
      for (int i = 0; i < kPack; ++i) {
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
          MmaS8(hi, cur.a[i][s], b_frag[nt * kPack + i][s][0][lane]);
          MmaS8(mid, cur.a[i][s], b_frag[nt * kPack + i][s][1][lane]);
          MmaS8(lo, cur.a[i][s], b_frag[nt * kPack + i][s][2][lane]);
        }
      }
      int hm[4];  // hi·256 + mid: at most 2^29, exact
#pragma unroll
      for (int e = 0; e < 4; ++e) hm[e] = hi[e] * 256 + mid[e];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float row_factor = sigma * cur.scale[h];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int e = 2 * h + c;
          const int v = 2 * nt + c;
          x[h][v] =
              fmaf(__int2float_rn(hm[e]), cs256[v], __int2float_rn(lo[e]) * cs[v]) * row_factor;
        }
      }
    }

    if (tile_pages) {
      float m[kV];
#pragma unroll
      for (int v = 0; v < kV; ++v) m[v] = fmaxf(x[0][v], x[1][v]);
      float page_max = TransposedReduce<kV>(m, lane, Max);
      float sums[kV];
#pragma unroll
      for (int v = 0; v < kV; ++v) {
        const float mv = __shfl_sync(kFullMask, page_max, HolderOf<kV>(lane, v));
        sums[v] = expf(x[0][v] - mv) + expf(x[1][v] - mv);
      }
      float page_sum = TransposedReduce<kV>(sums, lane, Add);
      if (steps_per_unit > 1) {  // merge the steps of one page
        if (step == 0) {
          run_max = page_max;
          run_sum = page_sum;
        } else {
          const float hi = fmaxf(run_max, page_max);
          const float e = expf(fminf(run_max, page_max) - hi);
          run_sum = page_max > run_max ? fmaf(run_sum, e, page_sum) : fmaf(page_sum, e, run_sum);
          run_max = hi;
        }
        if (step != steps_per_unit - 1) return;
        page_max = run_max;
        page_sum = run_sum;
      }
      // The lane holds C value held_v (column held_col). The max over the token's columns:
      // c ^ 1 (lane bit 2·kV), then qi ^ 1 and qi ^ 2.
      float best = held_padding ? -INFINITY : page_max + logf(page_sum);
      const float other_c = __shfl_xor_sync(kFullMask, best, 2 * kV);
      if (gp >= 2) best = fmaxf(best, other_c);
      const float other_q1 = __shfl_xor_sync(kFullMask, best, 1);
      if (gp >= 4) best = fmaxf(best, other_q1);
      const float other_q2 = __shfl_xor_sync(kFullMask, best, 2);
      if (gp >= 8) best = fmaxf(best, other_q2);
      const int64_t page = unit * kPack + tile;
      const float score = best * inv_sigma;
      if (held_writer && page < args.num_pages) {
        held_scores[page] = score == 0.0f ? 0.0f : score;
      }
      return;
    }
    const int levels = grid.page_shift;  // rows gi, gi + 8: pages of 2^levels rows
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float lse[kV];
#pragma unroll
      for (int v = 0; v < kV; ++v) {
        float mv = x[h][v];
        for (int l = 0; l < levels; ++l) mv = fmaxf(mv, __shfl_xor_sync(kFullMask, mv, 4 << l));
        float sum = expf(x[h][v] - mv);
        for (int l = 0; l < levels; ++l) sum += __shfl_xor_sync(kFullMask, sum, 4 << l);
        lse[v] = (column(v) & gp_mask) >= group ? -INFINITY : mv + logf(sum);
      }
      const int64_t row = row0 + tile * 16 + gi + 8 * h;
      const bool page_writer = (gi & ((1 << levels) - 1)) == 0 && row < rows_total;
      const int64_t page = row >> levels;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        // Token columns: 2qi + c of n-tile nt; the max over them as above, in-thread for c.
        float best = gp >= 2 ? fmaxf(lse[2 * nt], lse[2 * nt + 1]) : lse[2 * nt];
        const float other_q1 = __shfl_xor_sync(kFullMask, best, 1);
        if (gp >= 4) best = fmaxf(best, other_q1);
        const float other_q2 = __shfl_xor_sync(kFullMask, best, 2);
        if (gp >= 8) best = fmaxf(best, other_q2);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = column(2 * nt + c);
          const int tt = col >> grid.gp_shift;
          const float score = (gp == 1 ? lse[2 * nt + c] : best) * inv_sigma;
          if (page_writer && (col & gp_mask) == 0 && tt < tokens) {
            scores[tt * token_stride + page] = score == 0.0f ? 0.0f : score;
          }
        }
      }
    }
  };

  int64_t it = 0;
  int step = 0;
  int slot = 0;
  while (it < its_count) {
    CpAsyncWait<kStages - 2>();  // this lane's copies of the step in `slot` are done
    __syncwarp();                // and every lane's; the previous slot is read
    issue(slot == 0 ? kStages - 1 : slot - 1);
    StepRows<kRank, kPack> cur;
    cur.Read(io, ring_addr + slot * Io::kBytes, ring + slot * Io::kBytes);
    const int64_t unit = first_unit + it * kScoreWarps;
    const int cur_step = step;
    if (++step == steps_per_unit) {
      step = 0;
      ++it;
    }
    process(cur, unit, cur_step);
    slot = slot + 1 == kStages ? 0 : slot + 1;
  }
}

// ---------------------------------------------------------------------------------------------
// kLowRank scores, generic kernel: grid x = blocks of kGenericThreads pages, y = kv head,
// z = token. q̃ of as many heads of the group as fit kGenericQTildeFloats at a time.
__global__ void __launch_bounds__(kGenericThreads)
    LowRankScoresGenericKernel(LowRankScoreArgs args) {
  __shared__ float q_tilde[kGenericQTildeFloats];
  const int64_t g = blockIdx.y;
  const int64_t t = blockIdx.z;
  const int64_t page = int64_t{blockIdx.x} * kGenericThreads + threadIdx.x;
  const int64_t group = args.num_q_heads / args.num_kv_heads;
  const int64_t rank = args.rank;
  const int64_t d_count = args.head_dim;
  const int64_t heads_per_pass = min(group, kGenericQTildeFloats / rank);
  const float sigma = args.softmax_scale;
  const int8_t* head_codes = args.coords + g * args.max_tokens * rank;
  const float* head_scales = args.scales + g * args.max_tokens;
  const float* basis = args.basis + g * d_count * rank;
  float best = -INFINITY;
  for (int64_t j0 = 0; j0 < group; j0 += heads_per_pass) {
    const int64_t heads = min(heads_per_pass, group - j0);
    __syncthreads();  // the previous pass's q̃ is no longer read
    for (int64_t i = threadIdx.x; i < heads * rank; i += kGenericThreads) {
      const int64_t j = i / rank;
      const int64_t r = i % rank;
      const float* q = args.q + t * args.q_row_stride + (g * group + j0 + j) * d_count;
      float acc = 0.0f;
      for (int64_t d = 0; d < d_count; ++d) acc = fmaf(q[d], basis[d * rank + r], acc);
      q_tilde[i] = acc;
    }
    __syncthreads();
    if (page >= args.num_pages) continue;
    for (int64_t j = 0; j < heads; ++j) {
      float m = -INFINITY;
      float sum = 0.0f;
      for (int64_t s = 0; s < args.page_tokens; ++s) {
        const int64_t row = page * args.page_tokens + s;
        const int8_t* codes = head_codes + row * rank;
        float dot = 0.0f;
        for (int64_t r = 0; r < rank; ++r) dot = fmaf(q_tilde[j * rank + r], codes[r], dot);
        const float x = dot * (sigma * head_scales[row]);
        if (x > m) {  // online logsumexp: rescale the sum to the new max
          sum = fmaf(sum, expf(m - x), 1.0f);
          m = x;
        } else {
          sum += expf(x - m);
        }
      }
      best = fmaxf(best, m + logf(sum));
    }
  }
  if (page < args.num_pages) {
    const float score = best * (1.0f / sigma);
    args.scores[(t * args.num_kv_heads + g) * args.num_pages + page] = score == 0.0f ? 0.0f : score;
  }
}

int Log2Ceil(int64_t x) {
  int shift = 0;
  while ((int64_t{1} << shift) < x) ++shift;
  return shift;
}

template <int kRank, int kNT, int kPack>
cudaError_t LaunchMma(const LowRankScoreArgs& args, int gp_shift, cudaStream_t stream) {
  using Io = StepIo<kRank, kPack>;
  constexpr size_t kRingBytes = size_t{kScoreWarps} * Io::kStages * Io::kBytes;
  auto* kernel = LowRankScoresMmaKernel<kRank, kNT, kPack>;
  // Once per kernel: the ring may pass the 48 KiB that needs no opt-in; the resident blocks.
  static const int per_sm = [kernel] {
    int blocks = 0;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kRingBytes)) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kScoreThreads, kRingBytes) !=
            cudaSuccess) {
      (void)cudaGetLastError();
      blocks = 0;
    }
    return blocks;
  }();
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  constexpr int64_t kStepRows = 16 * kPack;
  ScoreGrid grid;
  grid.gp_shift = gp_shift;
  grid.page_shift = args.page_tokens < 16 ? Log2Ceil(args.page_tokens) : 4;
  grid.tokens_per_block = std::min<int64_t>(args.num_tokens, (kNT * 8 / kPack) >> gp_shift);
  const int64_t token_tiles = (args.num_tokens + grid.tokens_per_block - 1) / grid.tokens_per_block;
  const int64_t unit_rows =
      args.page_tokens > kStepRows && args.page_tokens >= 16 ? args.page_tokens : kStepRows;
  const int64_t units = (args.num_pages * args.page_tokens + unit_rows - 1) / unit_rows;
  // One wave: the resident blocks shared out among the (kv head, column tile) pairs.
  const int64_t slots = int64_t{per_sm} * args.num_sms;
  const int64_t blocks_per_pair = std::max<int64_t>(1, slots / (args.num_kv_heads * token_tiles));
  grid.iters = std::max<int64_t>(
      1, (units + blocks_per_pair * kScoreWarps - 1) / (blocks_per_pair * kScoreWarps));
  const int64_t units_per_block = grid.iters * kScoreWarps;
  const dim3 blocks(static_cast<unsigned>((units + units_per_block - 1) / units_per_block),
                    static_cast<unsigned>(args.num_kv_heads), static_cast<unsigned>(token_tiles));
  kernel<<<blocks, kScoreThreads, kRingBytes, stream>>>(args, grid);
  return cudaGetLastError();
}

// The column layout: two tiles per n-tile for up to 4 columns (pages of at most 16 rows), else
// 1, 2 or 4 n-tiles (column tiles of 32 columns past that).
template <int kRank>
cudaError_t LaunchMmaColumns(const LowRankScoreArgs& args, cudaStream_t stream) {
  const int gp_shift = Log2Ceil(args.num_q_heads / args.num_kv_heads);
  const int64_t columns = args.num_tokens << gp_shift;
  if (columns <= 4 && args.page_tokens <= 16) return LaunchMma<kRank, 1, 2>(args, gp_shift, stream);
  if (columns <= 8) return LaunchMma<kRank, 1, 1>(args, gp_shift, stream);
  if (columns <= 16) return LaunchMma<kRank, 2, 1>(args, gp_shift, stream);
  return LaunchMma<kRank, 4, 1>(args, gp_shift, stream);
}

}  // namespace

bool LowRankScoresUseTensorCores(const LowRankScoreArgs& args) {
  if (args.rank != 32 && args.rank != 64 && args.rank != 128) return false;
  if (args.num_kv_heads <= 0 || args.num_q_heads / args.num_kv_heads > 8) return false;
  const int64_t p = args.page_tokens;
  if (!(p == 1 || p == 2 || p == 4 || p == 8 || (p > 0 && p % kTileRows == 0))) return false;
  return reinterpret_cast<uintptr_t>(args.coords) % 16 == 0;
}

cudaError_t LaunchLowRankScores(const LowRankScoreArgs& args, cudaStream_t stream) {
  if (args.num_tokens <= 0 || args.num_kv_heads <= 0 || args.num_pages <= 0) return cudaSuccess;
  if (LowRankScoresUseTensorCores(args)) {
    switch (args.rank) {
      case 32:
        return LaunchMmaColumns<32>(args, stream);
      case 64:
        return LaunchMmaColumns<64>(args, stream);
      default:
        return LaunchMmaColumns<128>(args, stream);
    }
  }
  const dim3 blocks(static_cast<unsigned>((args.num_pages + kGenericThreads - 1) / kGenericThreads),
                    static_cast<unsigned>(args.num_kv_heads),
                    static_cast<unsigned>(args.num_tokens));
  LowRankScoresGenericKernel<<<blocks, kGenericThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace tandem::gpu_worker::cuda_backend
