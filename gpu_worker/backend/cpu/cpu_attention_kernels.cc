#include "cpu_attention_kernels.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cpu_vector_kernels.h"
#include "tandem/common/dnnl_call.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_attention/merge_state.h"

namespace tandem::gpu_worker::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = std::numbers::log2e_v<float>;
constexpr float kLn2 = std::numbers::ln2_v<float>;

// Query rows (tokens × group) per work unit: enough for an efficient sgemm, few enough that a
// T = 512 prefill chunk gives every thread several units.
constexpr int64_t kTargetRows = 192;
// Scores per tile [rows, slot tile] (192 KB of f32): the tile stays in L2 between Q·Kᵀ, the
// softmax and P·V. Decode (few rows) gets long slot tiles instead.
constexpr int64_t kScoreFloats = int64_t{48} * 1024;
constexpr int64_t kMinSlotTile = 256;
constexpr int64_t kMaxSlotTile = 2048;
// Below this many flops a call runs on one thread (a decode step over 8K slots is ~1.3e7): the
// OpenMP team costs more than it saves, much more on a loaded host.
constexpr double kParallelFlops = 2e7;
// A slot split shorter than this is not worth its merge.
constexpr int64_t kMinSplitSlots = 1024;

// Positions of the non-empty slots of one slot tile.
struct SlotTile {
  int32_t min_pos;
  int32_t max_pos;
  int32_t valid;  // slots with slot_pos >= 0
};

struct Plan {
  int64_t T = 0, Hq = 0, Hkv = 0, G = 0, D = 0, S = 0, cap = 0;
  int64_t unit_tokens = 0;  // query tokens per work unit
  int64_t num_qt = 0;       // query units per kv head
  int64_t slot_tile = 0;
  int64_t num_tiles = 0;
  int64_t num_splits = 1;   // slot ranges per (query unit, kv head)
  int64_t split_tiles = 0;  // slot tiles per split
  float scale2 = 0.0f;      // scale · log2(e): scores in the base-2 domain
  bool bf16 = false;
  int threads = 1;
  int64_t units() const { return num_qt * Hkv * num_splits; }
};

// One work unit: query tokens [t0, t0 + nt) of kv head g over slot tiles [tile_begin, tile_end).
struct Unit {
  int64_t qt, g, split, t0, nt, tile_begin, tile_end;
};

Unit MakeUnit(const Plan& plan, int64_t u) {
  Unit unit;
  unit.split = u % plan.num_splits;
  unit.g = (u / plan.num_splits) % plan.Hkv;
  unit.qt = u / (plan.num_splits * plan.Hkv);
  unit.t0 = unit.qt * plan.unit_tokens;
  unit.nt = std::min(plan.unit_tokens, plan.T - unit.t0);
  unit.tile_begin = unit.split * plan.split_tiles;
  unit.tile_end = std::min(plan.num_tiles, unit.tile_begin + plan.split_tiles);
  return unit;
}

// Per-thread scratch, reused across calls (OpenMP keeps its threads).
struct UnitScratch {
  ScratchBuffer qs;      // [M, D] query rows times scale2
  ScratchBuffer scores;  // [M, slot tile]
  ScratchBuffer acc;     // [M, D] running P·V
  ScratchBuffer rows;    // [3, M]: running max, running sum, final lse (base 2)
  ScratchBuffer k, v;    // [slot tile, D] bf16 tiles widened to f32
};

UnitScratch& ThreadScratch() {
  thread_local UnitScratch scratch;
  return scratch;
}

enum class TileKind { kSkip, kFull, kMasked };

TileKind Classify(const SlotTile& tile, int64_t ns, int32_t q_min, int32_t q_max) {
  if (tile.valid == 0 || tile.min_pos > q_max) return TileKind::kSkip;
  if (tile.valid == ns && tile.max_pos <= q_min) return TileKind::kFull;
  return TileKind::kMasked;
}

// The rows of the unit's queries in sgemm layout: row r = (t - t0) · G + j is head g·G + j of
// token t, multiplied by scale · log2(e).
void PrepareQ(const Plan& plan, const WindowAttentionParams& p, const Unit& unit, float* qs) {
  for (int64_t t = 0; t < unit.nt; ++t) {
    const float* src = p.q + (unit.t0 + t) * p.q_row_stride + unit.g * plan.G * plan.D;
    ScaleCopy(src, plan.G * plan.D, plan.scale2, qs + t * plan.G * plan.D);
  }
}

// The K (and V when v != nullptr) rows of slots [s0, s0 + ns) of kv head g as f32.
absl::Status LoadTile(const Plan& plan, const WindowAttentionParams& p, UnitScratch& scratch,
                      int64_t g, int64_t s0, int64_t ns, const float** k, const float** v) {
  const int64_t offset = (g * plan.cap + s0) * plan.D;
  if (!plan.bf16) {
    *k = static_cast<const float*>(p.k_cache) + offset;
    if (v != nullptr) *v = static_cast<const float*>(p.v_cache) + offset;
    return absl::OkStatus();
  }
  float* kf = scratch.k.Get<float>(static_cast<size_t>(plan.slot_tile * plan.D));
  float* vf =
      v != nullptr ? scratch.v.Get<float>(static_cast<size_t>(plan.slot_tile * plan.D)) : nullptr;
  if (kf == nullptr || (v != nullptr && vf == nullptr)) {
    return absl::ResourceExhaustedError("WindowAttention: out of memory for a KV tile");
  }
  Bf16ToF32(static_cast<const uint16_t*>(p.k_cache) + offset, kf, ns * plan.D);
  *k = kf;
  if (v != nullptr) {
    Bf16ToF32(static_cast<const uint16_t*>(p.v_cache) + offset, vf, ns * plan.D);
    *v = vf;
  }
  return absl::OkStatus();
}

// scores [M, ns] = qs [M, D] · k [ns, D]ᵀ, then the causal mask when the tile needs one.
absl::Status TileScores(const Plan& plan, const WindowAttentionParams& p, const Unit& unit,
                        TileKind kind, const float* qs, const float* k, int64_t s0, int64_t ns,
                        float* scores) {
  const int64_t M = unit.nt * plan.G;
  TANDEM_DNNL_STATUS(
      absl::StrCat("window attention scores [", M, ", ", plan.D, "] x [", plan.D, ", ", ns, "]"),
      dnnl_sgemm('N', 'T', M, ns, plan.D, 1.0f, qs, plan.D, k, plan.D, 0.0f, scores, ns));
  if (kind == TileKind::kMasked) {
    for (int64_t r = 0; r < M; ++r) {
      MaskRow(scores + r * ns, ns, p.slot_pos + s0, p.q_pos[unit.t0 + r / plan.G]);
    }
  }
  return absl::OkStatus();
}

void QueryPosRange(const WindowAttentionParams& p, const Unit& unit, int32_t* q_min,
                   int32_t* q_max) {
  *q_min = std::numeric_limits<int32_t>::max();
  *q_max = std::numeric_limits<int32_t>::min();
  for (int64_t t = unit.t0; t < unit.t0 + unit.nt; ++t) {
    *q_min = std::min(*q_min, p.q_pos[t]);
    *q_max = std::max(*q_max, p.q_pos[t]);
  }
}

// Attention of one unit; writes o [T, Hq, D] and lse [T, Hq] rows of its (token, head) pairs.
absl::Status AttentionUnit(const Plan& plan, const WindowAttentionParams& p, const SlotTile* tiles,
                           const Unit& unit, float* o, float* lse) {
  UnitScratch& scratch = ThreadScratch();
  const int64_t M = unit.nt * plan.G, D = plan.D;
  float* qs = scratch.qs.Get<float>(static_cast<size_t>(M * D));
  float* scores = scratch.scores.Get<float>(static_cast<size_t>(M * plan.slot_tile));
  float* acc = scratch.acc.Get<float>(static_cast<size_t>(M * D));
  float* row_m = scratch.rows.Get<float>(static_cast<size_t>(3 * M));
  if (qs == nullptr || scores == nullptr || acc == nullptr || row_m == nullptr) {
    return absl::ResourceExhaustedError("WindowAttention: out of memory for scratch");
  }
  float* row_l = row_m + M;
  PrepareQ(plan, p, unit, qs);
  std::fill_n(row_m, M, kNegInf);
  std::fill_n(row_l, M, 0.0f);
  std::fill_n(acc, M * D, 0.0f);
  int32_t q_min, q_max;
  QueryPosRange(p, unit, &q_min, &q_max);

  for (int64_t tile = unit.tile_begin; tile < unit.tile_end; ++tile) {
    const int64_t s0 = tile * plan.slot_tile;
    const int64_t ns = std::min(plan.slot_tile, plan.S - s0);
    const TileKind kind = Classify(tiles[tile], ns, q_min, q_max);
    if (kind == TileKind::kSkip) continue;
    const float* k = nullptr;
    const float* v = nullptr;
    TANDEM_RETURN_IF_ERROR(LoadTile(plan, p, scratch, unit.g, s0, ns, &k, &v));
    TANDEM_RETURN_IF_ERROR(TileScores(plan, p, unit, kind, qs, k, s0, ns, scores));
    // Online softmax: rescale each row's running state to the new maximum, P in place.
    for (int64_t r = 0; r < M; ++r) {
      float* row = scores + r * ns;
      const float m_new = std::max(row_m[r], RowMax(row, ns));
      if (m_new == kNegInf) {  // nothing visible to this row yet: P = 0, state unchanged
        std::fill_n(row, ns, 0.0f);
        continue;
      }
      const float alpha = row_m[r] == m_new ? 1.0f : Exp2Approx(row_m[r] - m_new);  // -inf: 0
      row_l[r] = row_l[r] * alpha + Exp2RowInPlace(row, ns, m_new);
      row_m[r] = m_new;
      if (alpha != 1.0f) ScaleRow(acc + r * D, D, alpha);
    }
    TANDEM_DNNL_STATUS(
        absl::StrCat("window attention P·V [", M, ", ", ns, "] x [", ns, ", ", D, "]"),
        dnnl_sgemm('N', 'N', M, D, ns, 1.0f, scores, ns, v, D, 1.0f, acc, D));
  }

  for (int64_t r = 0; r < M; ++r) {
    const int64_t t = unit.t0 + r / plan.G;
    const int64_t h = unit.g * plan.G + r % plan.G;
    float* o_row = o + (t * plan.Hq + h) * D;
    if (row_l[r] > 0.0f) {
      ScaleCopy(acc + r * D, D, 1.0f / row_l[r], o_row);
      lse[t * plan.Hq + h] = (row_m[r] + std::log2(row_l[r])) * kLn2;
    } else {  // no visible slot: the empty state
      std::fill_n(o_row, D, 0.0f);
      lse[t * plan.Hq + h] = kNegInf;
    }
  }
  return absl::OkStatus();
}

// MAW pass of one unit: colsum[s0 + i] = Σ over the unit's rows of w = 2^(score2 - lse2) for its
// slot tiles (colsum: the [num_slots] row of (query unit, kv head)).
absl::Status MawUnit(const Plan& plan, const WindowAttentionParams& p, const SlotTile* tiles,
                     const Unit& unit, float* colsum) {
  UnitScratch& scratch = ThreadScratch();
  const int64_t M = unit.nt * plan.G, D = plan.D;
  float* qs = scratch.qs.Get<float>(static_cast<size_t>(M * D));
  float* scores = scratch.scores.Get<float>(static_cast<size_t>(M * plan.slot_tile));
  float* lse2 = scratch.rows.Get<float>(static_cast<size_t>(3 * M));
  if (qs == nullptr || scores == nullptr || lse2 == nullptr) {
    return absl::ResourceExhaustedError("WindowAttention: out of memory for scratch");
  }
  PrepareQ(plan, p, unit, qs);
  for (int64_t r = 0; r < M; ++r) {
    const int64_t t = unit.t0 + r / plan.G;
    const int64_t h = unit.g * plan.G + r % plan.G;
    lse2[r] = p.lse[t * plan.Hq + h] * kLog2e;  // -inf stays -inf: the row adds nothing
  }
  int32_t q_min, q_max;
  QueryPosRange(p, unit, &q_min, &q_max);

  for (int64_t tile = unit.tile_begin; tile < unit.tile_end; ++tile) {
    const int64_t s0 = tile * plan.slot_tile;
    const int64_t ns = std::min(plan.slot_tile, plan.S - s0);
    float* col = colsum + s0;
    std::fill_n(col, ns, 0.0f);
    const TileKind kind = Classify(tiles[tile], ns, q_min, q_max);
    if (kind == TileKind::kSkip) continue;
    const float* k = nullptr;
    TANDEM_RETURN_IF_ERROR(LoadTile(plan, p, scratch, unit.g, s0, ns, &k, nullptr));
    TANDEM_RETURN_IF_ERROR(TileScores(plan, p, unit, kind, qs, k, s0, ns, scores));
    for (int64_t r = 0; r < M; ++r) {
      if (lse2[r] != kNegInf) Exp2AddToColumns(scores + r * ns, ns, lse2[r], col);
    }
  }
  return absl::OkStatus();
}

// Runs fn(u) for u < units on `threads` threads; the first failure is returned.
template <typename Fn>
absl::Status ForEachUnit(int threads, int64_t units, const Fn& fn) {
  if (threads <= 1 || units <= 1) {
    OmpThreadsScope one_thread(1);  // keeps sgemm on this thread
    for (int64_t u = 0; u < units; ++u) TANDEM_RETURN_IF_ERROR(fn(u));
    return absl::OkStatus();
  }
  absl::Status first_error;
  // Inside the team oneDNN sees omp_in_parallel() and runs each sgemm on its caller's thread.
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t u = 0; u < units; ++u) {
    absl::Status status = fn(u);
    if (!status.ok()) {
#pragma omp critical(tandem_cpu_window_attention_error)
      if (first_error.ok()) first_error = std::move(status);
    }
  }
  return first_error;
}

Plan MakePlan(const WindowAttentionParams& p, int max_threads) {
  Plan plan;
  plan.T = p.num_tokens;
  plan.Hq = p.num_q_heads;
  plan.Hkv = p.num_kv_heads;
  plan.G = p.num_q_heads / p.num_kv_heads;
  plan.D = p.head_dim;
  plan.S = p.num_slots;
  plan.cap = p.capacity;
  plan.bf16 = p.cache_dtype == DType::kBF16;
  plan.scale2 = p.scale * kLog2e;
  plan.unit_tokens = std::clamp<int64_t>((kTargetRows + plan.G - 1) / plan.G, 1, plan.T);
  plan.num_qt = (plan.T + plan.unit_tokens - 1) / plan.unit_tokens;
  const int64_t rows = plan.unit_tokens * plan.G;
  plan.slot_tile = std::clamp<int64_t>(kScoreFloats / rows / 64 * 64, kMinSlotTile, kMaxSlotTile);
  plan.num_tiles = (plan.S + plan.slot_tile - 1) / plan.slot_tile;
  const double flops = 4.0 * static_cast<double>(plan.T * plan.Hq) * static_cast<double>(plan.S) *
                       static_cast<double>(plan.D);
  plan.threads = flops < kParallelFlops ? 1 : max_threads;
  plan.num_splits = 1;
  const int64_t units = plan.num_qt * plan.Hkv;
  if (plan.threads > 1 && units < int64_t{2} * plan.threads) {
    const int64_t want = (int64_t{2} * plan.threads + units - 1) / units;
    plan.num_splits = std::clamp<int64_t>(plan.S / kMinSplitSlots, 1, want);
  }
  plan.split_tiles = std::max<int64_t>(1, (plan.num_tiles + plan.num_splits - 1) / plan.num_splits);
  plan.num_splits =
      std::max<int64_t>(1, (plan.num_tiles + plan.split_tiles - 1) / plan.split_tiles);
  return plan;
}

}  // namespace

absl::Status ValidateWindowAttention(const WindowAttentionParams& p) {
  if (p.q == nullptr || p.q_pos == nullptr || p.k_cache == nullptr || p.v_cache == nullptr ||
      p.slot_pos == nullptr || p.o == nullptr || p.lse == nullptr) {
    return absl::InvalidArgumentError(
        "WindowAttention: q, q_pos, k_cache, v_cache, slot_pos, o and lse must not be null");
  }
  if (p.num_tokens <= 0 || p.num_q_heads <= 0 || p.num_kv_heads <= 0 || p.head_dim <= 0 ||
      p.capacity <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "WindowAttention: num_tokens (%d), num_q_heads (%d), num_kv_heads (%d), head_dim (%d) "
        "and capacity (%d) must be positive",
        p.num_tokens, p.num_q_heads, p.num_kv_heads, p.head_dim, p.capacity));
  }
  if (p.num_slots < 0 || p.num_slots > p.capacity) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "WindowAttention: num_slots %d is outside [0, capacity = %d]", p.num_slots, p.capacity));
  }
  if (p.num_q_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("WindowAttention: num_q_heads %d is not a multiple of num_kv_heads %d",
                        p.num_q_heads, p.num_kv_heads));
  }
  if (p.q_row_stride < p.num_q_heads * p.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("WindowAttention: q_row_stride %d is below num_q_heads · head_dim = %d",
                        p.q_row_stride, p.num_q_heads * p.head_dim));
  }
  if (p.cache_dtype != DType::kF32 && p.cache_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "WindowAttention: cache dtype %s is not f32 or bf16", DTypeName(p.cache_dtype)));
  }
  if (!std::isfinite(p.scale) || p.scale <= 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrFormat("WindowAttention: scale %g must be finite and positive", p.scale));
  }
  if (p.maw != nullptr && !(p.alpha >= 0.0f && p.alpha <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("WindowAttention: alpha %g must be in [0, 1]", p.alpha));
  }
  return absl::OkStatus();
}

absl::Status WindowAttentionRunner::Run(const WindowAttentionParams& p) {
  const Plan plan = MakePlan(p, threads_);

  // Visibility summary of every slot tile (one pass over slot_pos).
  SlotTile* tiles = tiles_.Get<SlotTile>(static_cast<size_t>(std::max<int64_t>(plan.num_tiles, 1)));
  if (tiles == nullptr) return absl::ResourceExhaustedError("WindowAttention: out of memory");
  for (int64_t tile = 0; tile < plan.num_tiles; ++tile) {
    SlotTile info{std::numeric_limits<int32_t>::max(), -1, 0};
    const int64_t end = std::min(plan.S, (tile + 1) * plan.slot_tile);
    for (int64_t s = tile * plan.slot_tile; s < end; ++s) {
      const int32_t pos = p.slot_pos[s];
      if (pos < 0) continue;
      info.min_pos = std::min(info.min_pos, pos);
      info.max_pos = std::max(info.max_pos, pos);
      ++info.valid;
    }
    tiles[tile] = info;
  }

  // Split s > 0 writes its partial states here; split 0 writes p.o / p.lse directly.
  const size_t o_floats = static_cast<size_t>(plan.T * plan.Hq * plan.D);
  const size_t lse_floats = static_cast<size_t>(plan.T * plan.Hq);
  float* partial = nullptr;
  if (plan.num_splits > 1) {
    partial =
        partial_.Get<float>((o_floats + lse_floats) * static_cast<size_t>(plan.num_splits - 1));
    if (partial == nullptr) return absl::ResourceExhaustedError("WindowAttention: out of memory");
  }
  auto split_o = [&](int64_t split) {
    return split == 0 ? p.o : partial + (split - 1) * (o_floats + lse_floats);
  };
  auto split_lse = [&](int64_t split) {
    return split == 0 ? p.lse : partial + (split - 1) * (o_floats + lse_floats) + o_floats;
  };
  TANDEM_RETURN_IF_ERROR(ForEachUnit(plan.threads, plan.units(), [&](int64_t u) {
    const Unit unit = MakeUnit(plan, u);
    return AttentionUnit(plan, p, tiles, unit, split_o(unit.split), split_lse(unit.split));
  }));
  for (int64_t split = 1; split < plan.num_splits; ++split) {
    cpu_attention::MergeStates(p.o, p.lse, split_o(split), split_lse(split), p.o, p.lse, lse_floats,
                               static_cast<size_t>(plan.D));
  }
  if (p.maw == nullptr || plan.S == 0) return absl::OkStatus();

  // MAW: per (query unit, kv head) column sums of the weights, then the mean and the update.
  const size_t row = static_cast<size_t>(plan.S);
  float* colsum = colsum_.Get<float>(static_cast<size_t>(plan.num_qt * plan.Hkv) * row);
  if (colsum == nullptr) return absl::ResourceExhaustedError("WindowAttention: out of memory");
  TANDEM_RETURN_IF_ERROR(ForEachUnit(plan.threads, plan.units(), [&](int64_t u) {
    const Unit unit = MakeUnit(plan, u);
    return MawUnit(plan, p, tiles, unit, colsum + (unit.qt * plan.Hkv + unit.g) * row);
  }));
  const float inv_rows = 1.0f / static_cast<float>(plan.T * plan.G);
  for (int64_t g = 0; g < plan.Hkv; ++g) {
    float* maw = p.maw + g * plan.cap;
    for (int64_t s = 0; s < plan.S; ++s) {
      if (p.slot_pos[s] < 0) continue;
      float sum = 0.0f;
      for (int64_t qt = 0; qt < plan.num_qt; ++qt) sum += colsum[(qt * plan.Hkv + g) * row + s];
      const float a = sum * inv_rows;
      maw[s] = maw[s] < 0.0f ? a : (1.0f - p.alpha) * maw[s] + p.alpha * a;
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker::cpu
