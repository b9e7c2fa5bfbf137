#include "tandem/cpu_attention/sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <new>
#include <numbers>
#include <numeric>
#include <vector>

#include "absl/strings/str_format.h"
#include "aligned_buffer.h"
#include "dnnl_matmul.h"
#include "range_count.h"
#include "softmax_kernels.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_isa/cpu_isa.h"
#include "tandem/cpu_attention/merge_state.h"
#include "tandem/cpu_attention/paged_attention.h"
#include "tandem/kv_store/int8_rows.h"

namespace tandem::cpu_attention {
namespace {

using internal::AlignedBuffer;
using internal::MatmulDesc;
using internal::MmType;
using internal::SoftmaxKernels;
using internal::ThreadMatmuls;
using kv_store::KvDType;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A range shorter than this costs more in per-task overhead (matmul calls, merges) than the
// parallelism saves.
constexpr uint64_t kMinRangeKeys = 256;
// Bound on the per-chunk score buffer [chunk, rows]: many query rows (prefill) shrink the chunk.
constexpr size_t kMaxScoreBytes = size_t{1} << 20;
// Every matmul has one of a few key counts, so decode steps with new lengths never JIT a new
// primitive: a tail shorter than a chunk runs as a multiple of the granule (chunk / kTailShapes)
// plus a remainder padded to a multiple of granule / kPadShapes. The padded window either ends at
// the piece's end and reaches back over keys already done (masked out), or, near the start of a
// short head, is a zero-padded copy. At most kTailShapes + kPadShapes key counts per (rows,
// head_dim, dtype). (oneDNN 2.6 serves runtime sizes with its generic gemm, ~2x slower here.)
constexpr uint32_t kTailShapes = 16;
constexpr uint32_t kPadShapes = 4;
// int8 KV with more than kInt8ScanMaxRows query rows is dequantised chunk by chunk into f32 K
// and V tiles (q * scale, exact) that the f32 matmuls then read (the timings below are of G 4
// decode, measured when this path still served it). f32 tiles measured faster than bf16 tiles
// with the hi/lo split here (2-core EPYC, 16K keys x 8 heads, G 4: 11.4 vs 14.8-21 ms per call;
// bf16 KV 10.6-10.9 ms), and add no rounding. Chunk size: on the 2-core dev box 2048 keys
// (2 x 1 MiB tiles at head_dim 128) beat 512 (node Attend, n 16384: 2.91-2.99 ms against
// 3.79-3.82 ms), but on the 16-core H100 host, where the scan is memory-bound
// (tandem-attend-bench --heads 8 --group 4 --n 131072,1048576), 2048 took 11.7 / 101.9 ms and
// 512 10.3 / 84.5 ms (bf16 KV: 6.2-8.2 / 49-66 ms): 512 keeps the tiles in L2 of a core that
// shares the memory bus with 15 others. The serving host rules.
constexpr uint32_t kInt8ChunkKeys = 512;
// int8 KV with at most this many query rows (T * G) skips the dequantised matmuls: PagedAttention's
// scan reads the codes in place (row_scan_kernels.h). One thread, 8 kv heads x 4096 entries in
// cache, G 4 (2-core EPYC, AVX-512 kernels): 4 rows 0.50 ms scan vs 1.24 ms matmuls, 8 rows
// 0.91 vs 1.60 ms, 12 rows 1.42 vs 1.68 ms, 16 rows 2.28 vs 1.99 ms, 32 rows 3.92 vs 3.44 ms.
// NOTE: in cache; the 16-core host's memory-bound scan may favour a higher bound (unmeasured).
constexpr uint64_t kInt8ScanMaxRows = 12;

// Derived sizes of one call. Matmul row 2r holds the bf16 hi part of query row r and row 2r + 1
// its lo part (split); with f32 KV, matmul row r is query row r.
struct Plan {
  uint32_t D = 0;      // head_dim
  uint32_t G = 0;      // group
  uint32_t M = 0;      // query rows = T * G
  uint32_t R = 0;      // matmul rows: 2M (bf16 split) or M (f32)
  bool split = false;  // bf16 (or int8) KV: hi/lo split of Q and P
  bool int8 = false;   // int8 KV rows, dequantised per chunk into f32 tiles
  MmType type = MmType::kF32;
  size_t elem = 4;      // bytes per element of the matmul's K and V operands
  size_t src_row = 0;   // bytes per stored K or V row (BlockFormat::row_bytes)
  float scale = 0.0f;
  float scale2 = 0.0f;  // scale * log2(e): scores in the base-2 domain
  const internal::SoftmaxKernels* kernels = nullptr;
  uint32_t chunk = 0;    // keys per full chunk
  uint32_t granule = 0;  // tail granule
  uint32_t pad = 0;      // remainder padding step: granule / kPadShapes
  uint32_t W = 0;        // block of the flat softmax loops: a multiple of lcm(M, 16)
};

// Where a piece writes its rows: row (t, j) at o + t * o_stride + j * D, lse + t * lse_stride + j.
struct RowsOut {
  float* o;
  size_t o_stride;
  float* lse;
  size_t lse_stride;
};

// Per-thread scratch, reused across calls; sized by the largest problem seen.
struct Workspace {
  AlignedBuffer qs;     // [R, D] split (bf16) or plain (f32) query rows
  AlignedBuffer st;     // [chunk, R] f32 raw scores (K · Qsᵀ)
  AlignedBuffer p;      // [chunk, R] probabilities (bf16 hi/lo pairs, or f32)
  AlignedBuffer oc;     // [R, D] f32 P · V of one chunk
  AlignedBuffer acc;    // [M, D] f32 running output
  AlignedBuffer rows;   // [4, M] running max, running sum, rescale, chunk max
  AlignedBuffer reps;   // [3, W] per-row vectors replicated with period M
  AlignedBuffer pad_k;  // [granule, D] zero-padded copy of a short head's remainder
  AlignedBuffer pad_v;  // [granule, D]
  AlignedBuffer deq_k;  // [chunk, D] f32 K tile dequantised from int8 rows
  AlignedBuffer deq_v;  // [chunk, D] f32 V tile
};

// hi = bf16(x), lo = bf16(x - hi): hi + lo carries ~16 significant bits of x.
void SplitBf16(const float* x, size_t n, uint16_t* hi, uint16_t* lo) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t h = internal::portable::Bf16Bits(x[i]);
    hi[i] = static_cast<uint16_t>(h);
    lo[i] = static_cast<uint16_t>(
        internal::portable::Bf16Bits(x[i] - internal::portable::Bf16BitsToFloat(h)));
  }
}

// acc[r] = alpha[r] * acc[r] + oc[2r] + oc[2r+1] (split) or + oc[r]; first: acc[r] = oc part.
TANDEM_VECTOR_CLONES
void Accumulate(float* acc, const float* oc, size_t rows, size_t d, const float* alpha, bool split,
                bool first) {
  for (size_t r = 0; r < rows; ++r) {
    float* a = acc + r * d;
    const float* o0 = oc + (split ? 2 * r : r) * d;
    const float* o1 = o0 + d;
    const float c = alpha[r];
    if (split && first) {
#pragma omp simd
      for (size_t x = 0; x < d; ++x) a[x] = o0[x] + o1[x];
    } else if (split) {
#pragma omp simd
      for (size_t x = 0; x < d; ++x) a[x] = a[x] * c + (o0[x] + o1[x]);
    } else if (first) {
#pragma omp simd
      for (size_t x = 0; x < d; ++x) a[x] = o0[x];
    } else {
#pragma omp simd
      for (size_t x = 0; x < d; ++x) a[x] = a[x] * c + o0[x];
    }
  }
}

Workspace& ThreadWorkspace() {
  thread_local Workspace ws;
  return ws;
}

absl::Status Validate(const AttentionParams& p, std::span<const HeadProblem> heads) {
  if (p.dtype != KvDType::kBf16 && p.dtype != KvDType::kF32 && p.dtype != KvDType::kInt8) {
    return absl::InvalidArgumentError("attention: dtype must be bf16, f32 or int8");
  }
  if (p.head_dim < 8 || p.head_dim > 256 || p.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "attention: head_dim %d must be in [8, 256], a multiple of 8", p.head_dim));
  }
  if (p.group < 1 || p.num_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "attention: group (%d) and num_tokens (%d) must be >= 1", p.group, p.num_tokens));
  }
  if (uint64_t{p.group} * p.num_tokens > (1u << 16)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "attention: %d query rows per kv head exceed 65536", uint64_t{p.group} * p.num_tokens));
  }
  const size_t row_floats = size_t{p.group} * p.head_dim;
  if (p.num_tokens > 1 && (p.q_token_stride < row_floats || p.o_token_stride < row_floats ||
                           p.lse_token_stride < p.group)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "attention: token strides (q %d, o %d, lse %d) must be >= (%d, %d, %d)", p.q_token_stride,
        p.o_token_stride, p.lse_token_stride, row_floats, row_floats, p.group));
  }
  if (p.chunk_keys < 16) {
    return absl::InvalidArgumentError(
        absl::StrFormat("attention: chunk_keys %d must be >= 16", p.chunk_keys));
  }
  if (p.tasks_per_thread < 1) {
    return absl::InvalidArgumentError("attention: tasks_per_thread must be >= 1");
  }
  if (!std::isfinite(p.scale) || p.scale < 0.0f) {
    return absl::InvalidArgumentError("attention: scale must be finite and >= 0");
  }
  for (size_t h = 0; h < heads.size(); ++h) {
    const HeadProblem& hp = heads[h];
    if (hp.q == nullptr || hp.o == nullptr || hp.lse == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("attention: head %d: null q, o or lse", h));
    }
    if (hp.n > 0 && (hp.k == nullptr || hp.v == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("attention: head %d: null k or v with n = %d", h, hp.n));
    }
  }
  return absl::OkStatus();
}

Plan MakePlan(const AttentionParams& p) {
  Plan plan;
  plan.D = p.head_dim;
  plan.G = p.group;
  plan.M = p.group * p.num_tokens;
  plan.int8 = p.dtype == KvDType::kInt8;
  plan.split = p.dtype == KvDType::kBf16;
  plan.R = plan.split ? 2 * plan.M : plan.M;
  plan.type = plan.split ? MmType::kBf16 : MmType::kF32;
  plan.elem = plan.split ? 2 : 4;
  plan.src_row = kv_store::BlockFormat{16, p.head_dim, p.dtype}.row_bytes();
  plan.scale = p.scale > 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  plan.scale2 = plan.scale * std::numbers::log2e_v<float>;
  plan.kernels = &internal::GetSoftmaxKernels();
  const size_t cap = std::max<size_t>(16, kMaxScoreBytes / (size_t{plan.R} * sizeof(float)));
  plan.chunk = static_cast<uint32_t>(std::min<size_t>(p.chunk_keys, cap / 16 * 16));
  if (plan.int8) plan.chunk = std::min(plan.chunk, kInt8ChunkKeys);
  plan.granule = std::max<uint32_t>(16, plan.chunk / kTailShapes / 16 * 16);
  plan.pad = std::max<uint32_t>(16, plan.granule / kPadShapes / 16 * 16);
  // Block length of the flat softmax loops: a multiple of lcm(M, kLanes), at least 256.
  const uint32_t lcm = plan.M * 16 / std::gcd(plan.M, 16u);
  plan.W = lcm * std::max(1u, 256 / lcm);
  return plan;
}

// Q rows of one head into the matmul layout (see Plan).
void PrepareQ(const Plan& plan, const AttentionParams& p, const float* q, std::byte* qs) {
  for (uint32_t r = 0; r < plan.M; ++r) {
    const float* src = q + (r / plan.G) * p.q_token_stride + (r % plan.G) * plan.D;
    if (plan.split) {
      uint16_t* hi = reinterpret_cast<uint16_t*>(qs) + size_t{2 * r} * plan.D;
      uint16_t* lo = hi + plan.D;
      SplitBf16(src, plan.D, hi, lo);
    } else {
      std::copy_n(src, plan.D, reinterpret_cast<float*>(qs) + size_t{r} * plan.D);
    }
  }
}

// Attention of one head's query rows over its keys [begin, end); writes O and LSE to `out`.
absl::Status ComputePiece(const Plan& plan, const AttentionParams& params, const HeadProblem& head,
                          uint64_t begin, uint64_t end, const RowsOut& out) {
  Workspace& ws = ThreadWorkspace();
  ThreadMatmuls& mm = ThreadMatmuls::ForThisThread();
  const uint32_t M = plan.M, R = plan.R, D = plan.D, W = plan.W;
  std::byte* qs = ws.qs.Get<std::byte>(size_t{R} * D * plan.elem);
  float* st = ws.st.Get<float>(size_t{plan.chunk} * R);
  std::byte* p = ws.p.Get<std::byte>(size_t{plan.chunk} * R * plan.elem);
  float* oc = ws.oc.Get<float>(size_t{R} * D);
  float* acc = ws.acc.Get<float>(size_t{M} * D);
  float* row_m = ws.rows.Get<float>(4 * size_t{M});
  float* row_l = row_m + M;
  float* row_alpha = row_l + M;
  float* row_cmax = row_alpha + M;
  float* max_rep = ws.reps.Get<float>(3 * size_t{W});
  float* m2_rep = max_rep + W;
  float* sum_rep = m2_rep + W;
  const SoftmaxKernels& kernels = *plan.kernels;

  // Running softmax state per query row, in the base-2 domain: row_m = max of scale2 * raw
  // score (scale2 = scale * log2(e)), row_l = sum of 2^(scale2 * raw - row_m).
  PrepareQ(plan, params, head.q, qs);
  std::fill_n(row_m, M, kNegInf);
  std::fill_n(row_l, M, 0.0f);

  const size_t row_bytes = plan.src_row;
  bool first = true;
  for (uint64_t off = begin; off < end;) {
    // The window of this step: nc keys from kc/vc, of which [v0, v0 + valid) are new.
    const uint64_t left = end - off;
    int64_t nc;
    uint64_t v0 = 0, valid;
    const std::byte* kc = head.k + off * row_bytes;
    const std::byte* vc = head.v + off * row_bytes;
    if (left >= plan.granule) {
      nc = static_cast<int64_t>(left >= plan.chunk ? plan.chunk
                                                   : left / plan.granule * plan.granule);
      valid = static_cast<uint64_t>(nc);
    } else {
      nc = static_cast<int64_t>((left + plan.pad - 1) / plan.pad * plan.pad);
      valid = left;
      if (end >= static_cast<uint64_t>(nc)) {
        v0 = static_cast<uint64_t>(nc) - left;  // reach back over keys already processed
        kc -= v0 * row_bytes;
        vc -= v0 * row_bytes;
      } else {
        std::byte* pk = ws.pad_k.Get<std::byte>(nc * row_bytes);
        std::byte* pv = ws.pad_v.Get<std::byte>(nc * row_bytes);
        std::memcpy(pk, kc, left * row_bytes);
        std::memcpy(pv, vc, left * row_bytes);
        std::memset(pk + left * row_bytes, 0, (nc - left) * row_bytes);
        std::memset(pv + left * row_bytes, 0, (nc - left) * row_bytes);
        kc = pk;
        vc = pv;
      }
    }
    if (plan.int8) {
      // The window's rows as f32 q * scale; zero rows (padding) give zeros.
      std::byte* dk = ws.deq_k.Get<std::byte>(nc * D * plan.elem);
      std::byte* dv = ws.deq_v.Get<std::byte>(nc * D * plan.elem);
      kv_store::DequantizeRowsInt8(kc, nc, D, KvDType::kF32, dk);
      kv_store::DequantizeRowsInt8(vc, nc, D, KvDType::kF32, dv);
      kc = dk;
      vc = dv;
    }

    // St [nc, R] = K [nc, D] · Qsᵀ [D, R]: K is the big operand and already in the row-major
    // layout brgemm reads directly (no reorder of K), unlike Q · Kᵀ.
    MatmulDesc qk;
    qk.m = nc;
    qk.k = D;
    qk.n = R;
    qk.src_type = qk.wei_type = plan.type;
    qk.dst_type = MmType::kF32;
    qk.src_strides = {D, 1};
    qk.wei_strides = {1, D};
    qk.dst_strides = {R, 1};
    TANDEM_RETURN_IF_ERROR(mm.Run(qk, nc, D, R, kc, qs, st));

    // Online softmax over the new keys' flat [valid, M] scores: index i is query row i % M.
    // P (4-byte elements: bf16 hi/lo pairs or f32, [nc, M]) is zero for the window's other keys.
    const size_t count = valid * M;
    const float* st_new = st + v0 * R;
    uint32_t* p4 = reinterpret_cast<uint32_t*>(p);
    if (valid != static_cast<uint64_t>(nc)) {
      std::fill_n(p4, v0 * M, 0u);
      std::fill_n(p4 + (v0 + valid) * M, (nc - v0 - valid) * M, 0u);
    }
    kernels.row_max(st_new, plan.split, count, W, max_rep);
    for (uint32_t r = 0; r < M; ++r) {
      float cmax = kNegInf;
      for (uint32_t j = r; j < W; j += M) cmax = std::max(cmax, max_rep[j]);
      row_cmax[r] = cmax * plan.scale2;  // scale2 > 0 keeps the maximum
    }
    for (uint32_t r = 0; r < M; ++r) {
      const float m_new = std::max(row_m[r], row_cmax[r]);
      row_alpha[r] = first ? 0.0f : std::exp2(row_m[r] - m_new);
      row_m[r] = m_new;
    }
    for (uint32_t j = 0; j < W; ++j) m2_rep[j] = row_m[j % M];
    if (plan.split) {
      kernels.exp_split(st_new, count, W, plan.scale2, m2_rep, sum_rep, p4 + v0 * M);
    } else {
      kernels.exp_f32(st_new, count, W, plan.scale2, m2_rep, sum_rep,
                      reinterpret_cast<float*>(p4) + v0 * M);
    }
    for (uint32_t r = 0; r < M; ++r) {
      float sum = 0.0f;
      for (uint32_t j = r; j < W; j += M) sum += sum_rep[j];
      row_l[r] = row_l[r] * row_alpha[r] + sum;
    }

    // Oc [R, D] = P [R, nc] · V [nc, D]; P is stored key-major ([nc, R]), hence strides {1, R}.
    MatmulDesc pv;
    pv.m = R;
    pv.k = nc;
    pv.n = D;
    pv.src_type = pv.wei_type = plan.type;
    pv.dst_type = MmType::kF32;
    pv.src_strides = {1, R};
    pv.wei_strides = {D, 1};
    pv.dst_strides = {D, 1};
    TANDEM_RETURN_IF_ERROR(mm.Run(pv, R, nc, D, p, vc, oc));
    Accumulate(acc, oc, M, D, row_alpha, plan.split, first);

    first = false;
    off += valid;
  }

  for (uint32_t r = 0; r < M; ++r) {
    const uint32_t t = r / plan.G, j = r % plan.G;
    float* o_row = out.o + t * out.o_stride + size_t{j} * D;
    float* lse = out.lse + t * out.lse_stride + j;
    if (!(row_l[r] > 0.0f) || row_m[r] == kNegInf) {
      std::fill_n(o_row, D, 0.0f);
      *lse = kNegInf;
      continue;
    }
    const float inv = 1.0f / row_l[r];
    const float* a = acc + size_t{r} * D;
    for (uint32_t x = 0; x < D; ++x) o_row[x] = a[x] * inv;
    *lse = (row_m[r] + std::log2(row_l[r])) * std::numbers::ln2_v<float>;
  }
  return absl::OkStatus();
}

// A contiguous part [begin, end) of one head's keys, computed by one task. slot < 0: writes the
// head's output rows; else partial state `slot`, merged into them after all tasks finished.
struct Piece {
  uint32_t head;
  uint64_t begin, end;
  int64_t slot;
};

}  // namespace

namespace internal {

const SoftmaxKernels& GetSoftmaxKernels() {
  static const SoftmaxKernels kPortable{portable::RowMax, portable::ExpSplit, portable::ExpF32,
                                        "portable"};
#if TANDEM_X86_KERNELS
  static const SoftmaxKernels kAvx512{avx512::RowMax, avx512::ExpSplit, portable::ExpF32, "avx512"};
  static const SoftmaxKernels kAvx512Bf16{avx512::RowMax, avx512::ExpSplitBf16, portable::ExpF32,
                                          "avx512_bf16"};
  static const bool has_bf16 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
  }();
  // The AVX2 set has no hand-written softmax: the portable kernels' AVX2 clones serve it.
  if (ActiveCpuIsa() == CpuIsa::kAvx512) return has_bf16 ? kAvx512Bf16 : kAvx512;
#endif
  return kPortable;
}

}  // namespace internal

namespace {

absl::Status SparseAttentionImpl(const AttentionParams& params, std::span<const HeadProblem> heads,
                                 ThreadPool& pool) {
  const Plan plan = MakePlan(params);
  const size_t D = plan.D, T = params.num_tokens, G = plan.G;
  auto head_out = [&](const HeadProblem& h) {
    return RowsOut{h.o, params.o_token_stride, h.lse, params.lse_token_stride};
  };

  uint64_t total = 0;
  for (const HeadProblem& h : heads) {
    total += h.n;
    if (h.n != 0) continue;
    for (size_t t = 0; t < T; ++t) {
      std::fill_n(h.o + t * params.o_token_stride, G * D, 0.0f);
      std::fill_n(h.lse + t * params.lse_token_stride, G, kNegInf);
    }
  }
  if (total == 0) return absl::OkStatus();

  // Cut the keys of all heads, end to end, into equal ranges (HGCA §3.3 head-merged tasks).
  const uint64_t num_ranges =
      RangeCount(total, kMinRangeKeys, uint64_t{params.tasks_per_thread} * pool.num_threads(),
                 2 * plan.src_row, uint64_t{plan.M} * (D + 1) * 4);
  std::vector<Piece> pieces;
  std::vector<size_t> range_first(num_ranges + 1);
  std::vector<uint32_t> pieces_of_head(heads.size(), 0);
  {
    size_t h = 0;
    uint64_t head_off = 0, pos = 0;
    for (uint64_t r = 0; r < num_ranges; ++r) {
      range_first[r] = pieces.size();
      const uint64_t range_end = (r + 1) * total / num_ranges;
      while (pos < range_end) {
        while (heads[h].n == 0) ++h;
        const uint64_t take = std::min(heads[h].n - head_off, range_end - pos);
        const int64_t slot = pieces_of_head[h]++ == 0 ? -1 : 0;
        pieces.push_back(Piece{static_cast<uint32_t>(h), head_off, head_off + take, slot});
        pos += take;
        head_off += take;
        if (head_off == heads[h].n) {
          ++h;
          head_off = 0;
        }
      }
    }
    range_first[num_ranges] = pieces.size();
  }
  int64_t num_slots = 0;
  for (Piece& piece : pieces) {
    if (piece.slot >= 0) piece.slot = num_slots++;
  }
  const size_t M = plan.M;
  const size_t slot_floats = M * D + M;
  thread_local AlignedBuffer partial_buffer;
  float* partials = partial_buffer.Get<float>(num_slots * slot_floats);
  auto slot_out = [&](int64_t slot) {
    float* base = partials + slot * slot_floats;
    return RowsOut{base, G * D, base + M * D, G};
  };

  std::vector<absl::Status> statuses(num_ranges);
  pool.ParallelFor(num_ranges, [&](size_t r) {
    try {
      for (size_t i = range_first[r]; i < range_first[r + 1]; ++i) {
        const Piece& piece = pieces[i];
        const HeadProblem& head = heads[piece.head];
        const RowsOut out = piece.slot < 0 ? head_out(head) : slot_out(piece.slot);
        absl::Status s = ComputePiece(plan, params, head, piece.begin, piece.end, out);
        if (!s.ok()) {
          statuses[r] = std::move(s);
          return;
        }
      }
    } catch (const std::bad_alloc&) {
      statuses[r] = absl::ResourceExhaustedError("attention: scratch allocation failed");
    } catch (const std::exception& e) {
      statuses[r] = absl::InternalError(absl::StrFormat("attention: %s", e.what()));
    }
  });
  for (const absl::Status& s : statuses) TANDEM_RETURN_IF_ERROR(s);

  // Merge the partial states of heads split across ranges, in key order.
  for (const Piece& piece : pieces) {
    if (piece.slot < 0) continue;
    const HeadProblem& head = heads[piece.head];
    const RowsOut src = slot_out(piece.slot);
    for (size_t t = 0; t < T; ++t) {
      for (size_t j = 0; j < G; ++j) {
        MergeStateInPlace(head.o + t * params.o_token_stride + j * D,
                          head.lse + t * params.lse_token_stride + j,
                          src.o + t * src.o_stride + j * D, src.lse[t * src.lse_stride + j], D);
      }
    }
  }
  return absl::OkStatus();
}

// The heads as runs of PagedAttention's scan, which widens the stored rows in registers: int8 KV
// with few query rows, and bf16 KV where oneDNN has no bf16 matmul. Each head's rows are one run
// (or a few: KvRun counts 32 bits).
absl::Status ScanAttention(const AttentionParams& params, std::span<const HeadProblem> heads,
                           ThreadPool& pool) {
  constexpr uint64_t kMaxRun = uint64_t{1} << 30;
  const size_t row_bytes = kv_store::BlockFormat{16, params.head_dim, params.dtype}.row_bytes();
  std::vector<KvRun> runs;
  std::vector<PagedProblem> problems(heads.size());
  for (size_t h = 0; h < heads.size(); ++h) {
    const HeadProblem& hp = heads[h];
    PagedProblem& pr = problems[h];
    pr.run_begin = runs.size();
    for (uint64_t off = 0; off < hp.n; off += kMaxRun) {
      const uint64_t n = std::min(kMaxRun, hp.n - off);
      runs.push_back(
          KvRun{hp.k + off * row_bytes, hp.v + off * row_bytes, static_cast<uint32_t>(n)});
    }
    pr.run_end = runs.size();
    pr.num_tokens = params.num_tokens;
    pr.q = hp.q;
    pr.o = hp.o;
    pr.lse = hp.lse;
    pr.q_token_stride = params.q_token_stride;
    pr.o_token_stride = params.o_token_stride;
    pr.lse_token_stride = params.lse_token_stride;
  }
  PagedParams pp;
  pp.dtype = params.dtype;
  pp.head_dim = params.head_dim;
  pp.group = params.group;
  pp.scale = params.scale;
  pp.tasks_per_thread = params.tasks_per_thread;
  return PagedAttention(pp, runs, problems, pool);
}

// bf16 KV runs on oneDNN's bf16 matmuls where it has them (AVX-512: AVX512_BF16 or AMX on
// newer parts); oneDNN 2.6 creates none on an AVX2-only CPU, or under TANDEM_CPU_ISA below
// avx512 (with DNNL_MAX_CPU_ISA, the forced-path tests), and the scan serves instead.
bool Bf16OnOneDnn() {
  return ActiveCpuIsa() == CpuIsa::kAvx512 && OneDnnHasBf16Matmul();
}

}  // namespace

std::string Bf16AttentionPath() {
  if (Bf16OnOneDnn()) return "oneDNN bf16 matmuls";
  return absl::StrFormat("register-widening scan (%s)", CpuIsaName(ActiveCpuIsa()));
}

absl::Status SparseAttention(const AttentionParams& params, std::span<const HeadProblem> heads,
                             ThreadPool& pool) {
  TANDEM_RETURN_IF_ERROR(Validate(params, heads));
  try {
    if (params.dtype == KvDType::kInt8 &&
        uint64_t{params.group} * params.num_tokens <= kInt8ScanMaxRows) {
      return ScanAttention(params, heads, pool);
    }
    if (params.dtype == KvDType::kBf16 && !Bf16OnOneDnn()) {
      return ScanAttention(params, heads, pool);
    }
    return SparseAttentionImpl(params, heads, pool);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("attention: out of memory for the task plan or scratch");
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrFormat("attention: %s", e.what()));
  }
}

}  // namespace tandem::cpu_attention
