// Backend: the device the model runs on. Two implementations exist: `cuda` (cuBLAS GEMMs and
// CUDA kernels, gpu_worker/backend/cuda) and `cpu` (the same math on the host, for machines
// without a GPU; gpu_worker/backend/cpu). The engine composes the Llama forward pass, the window
// KV cache and the hybrid merge from these operations only, so both backends run the same model
// code and can be compared op by op.
//
// Memory: every pointer passed to an operation is "device memory" of this backend: memory from
// Allocate() (plus an offset). For `cpu` that is host memory; for `cuda` it is GPU memory. Host
// pointers appear only in the Copy* functions, where the parameter name says which side is which.
//
// Ordering: operations run in issue order on one backend stream. They may be asynchronous:
// CopyToHost/CopyToDevice/Synchronize are the points where the host waits (CopyToHost returns
// only when the data is in host memory; CopyToDevice returns when `src_host` may be reused).
//
// Numerics (both backends): activations are f32. MatMul rounds its input `x` to the weight's
// dtype (bf16/f16 weights: x is rounded to bf16/f16; f32 weights: x stays f32) and accumulates
// in f32, so a bf16 model computes bf16 x bf16 products with f32 sums, like cuBLAS bf16 GEMMs.
// Everything else (norms, RoPE, softmax, merge) is f32. KV caches are f32 or bf16.
//
// Errors: operations return INVALID_ARGUMENT for parameters that break the stated contract
// (checked cheaply: null pointers, zero or negative sizes, unsupported dtypes), INTERNAL for a
// failing CUDA/cuBLAS/oneDNN call (the message names the call, file and line). They never abort.
//
// Thread safety: none. One thread (the engine's executor) owns a backend and calls it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker {

// A block of backend memory; move-only; freed by the backend's deleter on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(void* data, size_t bytes, std::function<void(void*)> deleter)
      : data_(data), bytes_(bytes), deleter_(std::move(deleter)) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = other.data_;
      bytes_ = other.bytes_;
      deleter_ = std::move(other.deleter_);
      other.data_ = nullptr;
      other.bytes_ = 0;
      other.deleter_ = nullptr;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  explicit operator bool() const { return data_ != nullptr; }

  void Reset() {
    if (data_ != nullptr && deleter_) deleter_(data_);
    data_ = nullptr;
    bytes_ = 0;
    deleter_ = nullptr;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::function<void(void*)> deleter_;
};

// out[t, :] = table[ids[t], :] converted to f32.
struct EmbedParams {
  const int32_t* ids = nullptr;  // [num_tokens], each in [0, vocab) (the engine validates)
  const void* table = nullptr;   // [vocab, hidden] of table_dtype
  DType table_dtype = DType::kF32;
  float* out = nullptr;          // [num_tokens, hidden]
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  int64_t vocab = 0;
};

// out[t, :] = x[t, :] * rsqrt(mean(x[t, :]^2) + eps) * weight[:]   (Llama RMSNorm, f32 math)
// for every vector of `hidden` floats: vectors_per_token of them side by side per token, token t
// at x + t·token_stride (0: packed, vectors_per_token·hidden). Qwen3's q/k norms run one call
// per projection over a qkv row: hidden = head_dim, vectors_per_token = heads, token_stride =
// the qkv row width.
struct RmsNormParams {
  const float* x = nullptr;       // [num_tokens, hidden] (packed), rows of token_stride else
  const void* weight = nullptr;   // [hidden] of weight_dtype
  DType weight_dtype = DType::kF32;
  float* out = nullptr;           // the layout of x; may alias x
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  float eps = 1e-5f;
  int64_t vectors_per_token = 1;
  int64_t token_stride = 0;       // floats; 0 or >= vectors_per_token·hidden
};

// y = x · wᵀ (+ bias) (+ y when accumulate): the nn.Linear layout. accumulate fuses the
// residual add; bias is for models with projection biases (Qwen2's q/k/v).
// FP8 weights (w_dtype kF8E4M3, only where SupportsFp8Weights()): row j of w is its e4m3 codes
// times w_scale[j]. Decode-sized m (cuda: 1-2 rows, and 3-4 rows for n <= 16384; gemv_fp8.cuh)
// computes w_scale[j]·Σ bf16(x)·code in f32 from the codes (within bf16 rounding of the exact
// product; the FP8 bytes are all it reads). Other m run on the FP8 tensor cores as FP8 servers
// do: each row of x quantized to e4m3 with its own scale (absmax/448: within 2^-4 of each |x|),
// products of codes summed in f32 and scaled by both row scales; where the device or cuBLASLt
// has no such GEMM (before sm_90, k % 16 != 0, n % 4 != 0, w or y not 16-byte aligned), the
// product of bf16(x) and the bf16 matrix bf16(code·w_scale[j]). So a row's numerics depend on
// the rows it is multiplied with: a decode row batched with 2 others may take the GEMM.
// The cuda backend's scratch for one FP8 GEMM (the quantized rows of x, their scales and
// cuBLASLt's workspace; or a slab of dequantized rows beside bf16 x): the memory plan counts it.
inline constexpr uint64_t kCudaFp8SlabBytes = uint64_t{32} << 20;

struct MatMulParams {
  const float* x = nullptr;   // [m, k], row stride k
  const void* w = nullptr;    // [n, k] of w_dtype, row stride k
  DType w_dtype = DType::kF32;     // kF32, kBF16, kF16, or kF8E4M3 (with w_scale)
  const float* w_scale = nullptr;  // [n] f32: kF8E4M3's row scales; null for the others
  const float* bias = nullptr;   // optional [n], added to every row
  float* y = nullptr;         // [m, n], row stride n; must not alias x
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  bool accumulate = false;
};

// Rotary embedding, Hugging Face "rotate_half" (half-split) convention, in place:
// for i < D/2 with c = cos(pos·inv_freq[i]) · attention_scaling, s = sin(...) · attention_scaling:
//   x'[i] = x[i]·c - x[i + D/2]·s,   x'[i + D/2] = x[i + D/2]·c + x[i]·s
// Angles are computed in f32 as float(pos) * inv_freq[i] (as transformers does).
struct RopeParams {
  float* x = nullptr;               // [num_tokens, num_heads, head_dim] rows of `row_stride`
  int64_t row_stride = 0;           // floats between token t and t+1 (>= num_heads·head_dim)
  const int32_t* positions = nullptr;   // [num_tokens]
  // [head_dim / 2] (device memory) shared by every token when inv_freq_row_stride is 0, else
  // [num_tokens, inv_freq_row_stride >= head_dim / 2]: token t uses inv_freq + t·stride (dynamic
  // NTK RoPE, whose frequencies depend on each sequence's length).
  const float* inv_freq = nullptr;
  int64_t inv_freq_row_stride = 0;
  float attention_scaling = 1.0f;   // multiplies cos and sin (yarn's attention factor)
  int64_t num_tokens = 0;
  int64_t num_heads = 0;
  int64_t head_dim = 0;             // even
};

// out[t, i] = silu(gate_up[t, i]) · gate_up[t, ffn + i]  for i < ffn  (SwiGLU; silu(x)=x/(1+e^-x))
struct SwiGluParams {
  const float* gate_up = nullptr;   // [num_tokens, 2·ffn]: gate columns first, then up
  float* out = nullptr;             // [num_tokens, ffn]
  int64_t num_tokens = 0;
  int64_t ffn = 0;
};

// Writes the K and V rows of new tokens into a KV cache at given slots, converting f32 to the
// cache dtype: k_cache[h, slots[t], :] = k[t, h, :] (same for v).
struct WriteKvParams {
  const float* k = nullptr;     // [num_tokens, num_kv_heads, head_dim], rows of `row_stride`
  const float* v = nullptr;     // same layout and stride as k
  int64_t row_stride = 0;       // floats between token t and t+1
  const int32_t* slots = nullptr;   // [num_tokens], distinct, in [0, capacity)
  void* k_cache = nullptr;      // [num_kv_heads, capacity, head_dim] of cache_dtype
  void* v_cache = nullptr;      // [num_kv_heads, capacity, head_dim] of cache_dtype
  DType cache_dtype = DType::kF32;   // kF32 or kBF16
  int64_t num_tokens = 0;
  int64_t num_kv_heads = 0;
  int64_t capacity = 0;
  int64_t head_dim = 0;
};

// Attention of query tokens over the entries of a KV cache ("the window"): for query token t,
// query head h (kv head g = h / G, G = num_q_heads / num_kv_heads) the visible entries are the
// slots s < num_slots with 0 <= slot_pos[s] <= q_pos[t] (slot_pos -1 = empty slot). Scores are
// q·k · scale with f32 accumulation. Returns the partial state over the visible entries:
//   o[t, h, :] = Σ_s softmax(score)_s · v[g, s, :],  lse[t, h] = log Σ_s exp(score_s)
// With no visible entry: o = 0, lse = -inf (the numerics contract of common.proto).
//
// MAW update (HGCA Alg. 1 line 8), when maw != nullptr: with w[t, h, s] = exp(score - lse[t, h])
// (0 when s is not visible to t), a[g, s] = mean over t < num_tokens and the G heads of group g
// of w[t, h, s], and for every slot s < num_slots with slot_pos[s] >= 0:
//   maw[g, s] = maw[g, s] < 0 ? a[g, s] : (1 - alpha) · maw[g, s] + alpha · a[g, s]
// (a negative maw marks an entry that has not been attended yet: it starts at its first weight).
struct WindowAttentionParams {
  const float* q = nullptr;       // [num_tokens, num_q_heads, head_dim], rows of q_row_stride
  int64_t q_row_stride = 0;       // floats between token t and t+1
  const int32_t* q_pos = nullptr; // [num_tokens] absolute positions of the query tokens
  const void* k_cache = nullptr;  // [num_kv_heads, capacity, head_dim] of cache_dtype
  const void* v_cache = nullptr;  // [num_kv_heads, capacity, head_dim] of cache_dtype
  DType cache_dtype = DType::kF32;
  const int32_t* slot_pos = nullptr;  // [capacity] absolute position of each slot, -1 = empty
  int64_t num_slots = 0;          // slots [0, num_slots) are scanned (<= capacity)
  int64_t capacity = 0;
  int64_t num_tokens = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  float scale = 0.0f;             // usually 1/sqrt(head_dim)
  float* o = nullptr;             // [num_tokens, num_q_heads, head_dim], contiguous
  float* lse = nullptr;           // [num_tokens, num_q_heads]
  float* maw = nullptr;           // optional: [num_kv_heads, capacity], updated in place
  float alpha = 0.0f;
};

// (o_dst, lse_dst) <- merge((o_dst, lse_dst), (o_src, lse_src)) for `rows` states, exactly the
// merge of cpu_attention/merge_state.h: an empty side (lse = -inf) leaves the other unchanged,
// two empty sides give o = 0, lse = -inf, never NaN.
struct MergeParams {
  float* o_dst = nullptr;          // [rows, head_dim]
  float* lse_dst = nullptr;        // [rows]
  const float* o_src = nullptr;    // [rows, head_dim]
  const float* lse_src = nullptr;  // [rows]
  int64_t rows = 0;
  int64_t head_dim = 0;
};

// Picks one token from logits of one row. temperature <= 0: argmax (the lowest index among
// equal maxima). Otherwise: p = softmax(logits / temperature); keep the top_k most probable
// (top_k <= 0: all), then the smallest most-probable set whose mass reaches top_p (top_p >= 1:
// all; the most probable token is always kept); renormalise; return the token at which the
// cumulative mass in ascending token-id order first exceeds `uniform` · (kept mass).
struct SampleParams {
  const float* logits = nullptr;  // [vocab]
  int64_t vocab = 0;
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float uniform = 0.0f;           // in [0, 1), drawn by the caller's seeded generator

  // Whether the rule above can keep only the most probable token, so the argmax is the answer
  // without a softmax or a sort: temperature <= 0, or a top_p no token's mass falls below (the
  // most probable token holds at least 1 / vocab of any softmax, and of a top-k cut of it).
  bool ArgmaxOnly() const {
    return temperature <= 0.0f ||
           (top_p > 0.0f && static_cast<double>(top_p) * static_cast<double>(vocab) <= 1.0);
  }
};

// out[t] = log_softmax(logits[t, :])[targets[t]]: the log-probability of each target token.
struct TokenLogProbParams {
  const float* logits = nullptr;    // [num_tokens, vocab]
  const int32_t* targets = nullptr; // [num_tokens], each in [0, vocab)
  float* out = nullptr;             // [num_tokens]
  int64_t num_tokens = 0;
  int64_t vocab = 0;
};

// dst[i] = scale · (2·u_i − 1) written as `dtype` (kF32, kBF16 or kF16; kF8E4M3 on the cuda
// backend, rounded as FloatToF8E4M3), where u_i in [0, 1) is the top 24 bits of splitmix64(seed + i
// · 0x9E3779B97F4A7C15) over 2^24: the same values on every backend. For synthetic weights and
// caches (benchmarks; speed does not depend on the values).
struct RandomFillParams {
  void* dst = nullptr;      // [count] of dtype
  DType dtype = DType::kF32;
  size_t count = 0;
  uint64_t seed = 0;
  float scale = 1.0f;
};

// A strided host-to-device copy on the upload stream: row r of `row_bytes` goes from
// src_host + r·src_pitch to dst + r·dst_pitch.
struct UploadParams {
  void* dst = nullptr;              // device memory
  size_t dst_pitch = 0;
  const void* src_host = nullptr;   // host memory from AllocateHost (page-locked on cuda)
  size_t src_pitch = 0;
  size_t row_bytes = 0;
  size_t rows = 0;
};

// A strided device-to-host copy of CopyToHostBatch: row r of `row_bytes` goes from
// src + r·src_pitch to dst_host + r·dst_pitch.
struct HostCopy2D {
  void* dst_host = nullptr;         // any host memory
  size_t dst_pitch = 0;
  const void* src = nullptr;        // device memory
  size_t src_pitch = 0;
  size_t row_bytes = 0;
  size_t rows = 0;

  bool empty() const { return row_bytes == 0 || rows == 0; }
};

// What every backend checks of a strided copy that moves something (CopyToHost2D,
// CopyToDevice2D, UploadAsync, each copy of CopyToHostBatch): both pointers set and pitches that
// hold a row.
// `what` names the call (and the copy) in the message.
inline absl::Status CheckStridedCopy(absl::string_view what, const void* dst, size_t dst_pitch,
                                     const void* src, size_t src_pitch, size_t row_bytes) {
  if (dst == nullptr || src == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": null pointer"));
  }
  if (dst_pitch < row_bytes || src_pitch < row_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": pitches (dst ", dst_pitch, ", src ",
                                                   src_pitch, ") must be >= row_bytes ",
                                                   row_bytes));
  }
  return absl::OkStatus();
}

// Page summaries for query-aware selection (Quest; DESIGN "Selection"): for each of `num_pages`
// pages of `page_tokens` consecutive slots of a window K cache, starting at `first_slot`, the
// elementwise min, max and mean of the page's keys, written as summary pages first_page.. of
// `summaries` (kPageSummaryRows rows per page):
//   summaries[g, first_page + i, 0, d] = min over slots s of the page of k_cache[g, s, d]
//   summaries[g, first_page + i, 1, d] = max over the same slots
//   summaries[g, first_page + i, 2, d] = their mean (an f32 sum in slot order, / page_tokens)
// in the cache dtype: a min or max of bf16 keys is a bf16 key value, so nothing is rounded; the
// mean is rounded once to the dtype.
inline constexpr int64_t kPageSummaryRows = 3;
struct SummarizePagesParams {
  const void* k_cache = nullptr;  // [num_kv_heads, capacity, head_dim] of dtype
  int64_t capacity = 0;
  int64_t first_slot = 0;         // pages cover slots [first_slot, first_slot + num_pages·page_tokens)
  int64_t num_pages = 0;
  int64_t page_tokens = 0;        // >= 1
  void* summaries = nullptr;      // [num_kv_heads, max_pages, 3, head_dim] of dtype (min, max, mean)
  int64_t max_pages = 0;          // page capacity of `summaries`
  int64_t first_page = 0;         // first_page + num_pages <= max_pages
  DType dtype = DType::kF32;      // of both k_cache and summaries: kF32 or kBF16
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
};

// How SelectPages scores a page against a query head (DESIGN "Selection"):
//   kBound     Quest's upper bound of the page's largest q·k: Σ_d max(q_d·min_d, q_d·max_d).
//              Never misses a page holding the largest key, but a page of spread keys scores
//              high whatever its mass.
//   kCentroid  q·mean: the page's typical key, which ranks pages by their bulk of mass.
//   kLowRank   the logsumexp of the page's keys' scores in a rank-R basis of the head's keys
//              (Loki's observation: keys live near a low-rank subspace): an estimate of the
//              page's softmax mass from every key in it, not from a summary
//              (SelectPagesParams::low_rank; ProjectKeys writes the coordinates).
// The default policy takes part of its budget by the bound and the rest by the centroid or the
// low-rank estimate (PagePolicy).
enum class PageScore { kBound, kCentroid, kLowRank };

// Low-rank keys (PageScore::kLowRank). A kv head's basis is `rank` orthonormal columns
// basis[g, :, r] (f32, [num_kv_heads, head_dim, rank]; the top eigenvectors of Σ k·kᵀ over its
// early keys, KeyGram). Each key keeps its coordinates c_r = Σ_d k_d·basis[g, d, r] as int8
// codes with one f32 scale per key: scale = max_r |c_r| / 127, code_r = round-to-nearest-even
// (c_r / scale) in [-127, 127] (scale 0 and codes 0 when every c_r is 0).
//
// KeyGram: gram[g, d, e] = Σ_s k[g, s, d]·k[g, s, e] over slots [first_slot, first_slot + count)
// (f32 products and sums, the order the backend's), overwriting `gram`.
struct KeyGramParams {
  const void* k = nullptr;   // [num_kv_heads, capacity, head_dim] of dtype (kF32 or kBF16)
  int64_t capacity = 0;
  int64_t first_slot = 0;
  int64_t count = 0;         // >= 1; first_slot + count <= capacity
  DType dtype = DType::kF32;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  float* gram = nullptr;     // [num_kv_heads, head_dim, head_dim] f32
};

// ProjectKeys: the codes and scales of the keys in slots [first_slot, first_slot + count) as
// coordinate rows first_token.. of `coords` and `scales` (f32 products and sums in d order; a
// code may differ by one between backends where c_r / scale falls within rounding of a half).
struct ProjectKeysParams {
  const void* k = nullptr;       // [num_kv_heads, capacity, head_dim] of dtype (kF32 or kBF16)
  int64_t capacity = 0;
  int64_t first_slot = 0;
  int64_t count = 0;             // >= 1; first_slot + count <= capacity
  DType dtype = DType::kF32;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  const float* basis = nullptr;  // [num_kv_heads, head_dim, rank] f32
  int64_t rank = 0;              // 1..head_dim
  int8_t* coords = nullptr;      // [num_kv_heads, max_tokens, rank]
  float* scales = nullptr;       // [num_kv_heads, max_tokens]
  int64_t max_tokens = 0;
  int64_t first_token = 0;       // first_token + count <= max_tokens
};

// The low-rank keys of one layer's pages, for PageScore::kLowRank: page p of kv head g is the
// coordinate rows [p·page_tokens, (p+1)·page_tokens) of head g.
struct LowRankKeys {
  const float* basis = nullptr;   // [num_kv_heads, head_dim, rank] f32
  const int8_t* coords = nullptr; // [num_kv_heads, max_tokens, rank] (ProjectKeys)
  const float* scales = nullptr;  // [num_kv_heads, max_tokens]
  int64_t rank = 0;               // 1..head_dim
  int64_t max_tokens = 0;         // >= num_pages · page_tokens
  int64_t page_tokens = 0;        // >= 1
  float softmax_scale = 0.0f;     // > 0: the attention's scale (1/sqrt(head_dim) usually)
};

// Query-aware page selection: scores every page of every kv head against each query token and
// keeps the best `select` pages per (token, kv head). With G = num_q_heads / num_kv_heads, the
// score of page p of kv head g for token t is the best over the group's query heads:
//   kBound:    score[t, g, p] = max over j < G of Σ_d max(q[t, g·G+j, d]·min[g, p, d], q[t, g·G+j, d]·max[g, p, d])
//   kCentroid: score[t, g, p] = max over j < G of Σ_d q[t, g·G+j, d]·mean[g, p, d]
//   kLowRank:  score[t, g, p] = max over j < G of (1/σ)·log Σ_{s in page p} exp(σ·a[g, s]·Σ_r q̃[t, j, r]·code[g, s, r])
//              with q̃[t, j, r] = Σ_d q[t, g·G+j, d]·basis[g, d, r], a = the key's scale, σ = softmax_scale
//              (in units of q·k as the other two; `summaries` unused, may be null)
// (f32 products and sums; the order of the sum is the backend's). With `keep`, the pages it
// names for a row count as scoring above every other page (they are kept, within `select`).
// pages[t, g, :] gets the `select` pages of highest score (ties: the lower page id wins), in
// ascending page id order; when num_pages <= select it gets every page 0..num_pages-1 followed by
// -1 padding.
struct SelectPagesParams {
  const float* q = nullptr;        // [num_tokens, num_q_heads, head_dim], rows of q_row_stride
  int64_t q_row_stride = 0;        // floats between token t and t+1
  const void* summaries = nullptr; // [num_kv_heads, max_pages, 3, head_dim] of dtype (SummarizePages)
  DType dtype = DType::kF32;       // kF32 or kBF16
  int64_t max_pages = 0;
  int64_t num_pages = 0;           // pages [0, num_pages) are candidates (>= 1, <= max_pages)
  int64_t num_tokens = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t select = 0;              // pages kept per (token, kv head), >= 1
  PageScore score = PageScore::kBound;
  LowRankKeys low_rank = {};       // kLowRank only
  // Optional: [num_tokens, num_kv_heads, keep_per_head] page ids kept whatever their score (a
  // first selection by another score); -1 and ids outside [0, num_pages) are ignored. Distinct
  // ids per row; 1 <= keep_per_head < select.
  const int32_t* keep = nullptr;
  int64_t keep_per_head = 0;
  int32_t* pages = nullptr;        // [num_tokens, num_kv_heads, select]
  // Scratch of at least SelectPagesScratchBytes(num_tokens, num_kv_heads, num_pages) bytes.
  void* scratch = nullptr;
};
// Scratch bytes SelectPages needs (the same bound for every backend: one f32 score per
// (token, kv head, page) plus 64 KiB).
inline size_t SelectPagesScratchBytes(int64_t num_tokens, int64_t num_kv_heads, int64_t num_pages) {
  return static_cast<size_t>(num_tokens) * num_kv_heads * num_pages * 4 + (64u << 10);
}

class Backend {
 public:
  // Upload slots of the ping-pong (double-buffered) stream: see UploadAsync.
  static constexpr int kUploadSlots = 4;

  virtual ~Backend() = default;

  virtual std::string_view name() const = 0;    // "cpu" or "cuda"
  // True when MatMul takes FP8 (kF8E4M3) weights; else DeviceModel dequantizes them on upload.
  virtual bool SupportsFp8Weights() const { return false; }
  virtual std::string device_description() const = 0;   // e.g. "NVIDIA H100 80GB HBM3"

  // Memory. Allocate returns RESOURCE_EXHAUSTED when the device is out of memory. The contents
  // of a new buffer are unspecified.
  virtual absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) = 0;
  virtual absl::Status CopyToDevice(void* dst, const void* src_host, size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* dst_host, const void* src, size_t bytes) = 0;
  // Strided copy of `rows` rows of `row_bytes`: row r goes from src + r·src_pitch to
  // dst_host + r·dst_pitch (used to gather one block of every kv head of a cache).
  virtual absl::Status CopyToHost2D(void* dst_host, size_t dst_pitch, const void* src,
                                    size_t src_pitch, size_t row_bytes, size_t rows) = 0;
  // `count` copies as CopyToHost2D each, with one wait for the device: returns when every one
  // is in host memory (cuda: small ones land in page-locked staging together and are copied
  // out after a single stream sync; the decode step downloads q and the chosen page ids so).
  // The default runs CopyToHost2D per copy.
  virtual absl::Status CopyToHostBatch(const HostCopy2D* copies, size_t count) {
    for (size_t i = 0; i < count; ++i) {
      const HostCopy2D& c = copies[i];
      absl::Status s = CopyToHost2D(c.dst_host, c.dst_pitch, c.src, c.src_pitch, c.row_bytes,
                                    c.rows);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  // The reverse (a parked cache going back to the device, WindowCache::Unpark): row r goes
  // from src_host + r·src_pitch to dst + r·dst_pitch. Returns once src_host may be reused.
  virtual absl::Status CopyToDevice2D(void* dst, size_t dst_pitch, const void* src_host,
                                      size_t src_pitch, size_t row_bytes, size_t rows) = 0;
  virtual absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) = 0;
  // Sets `count` floats at dst to `value`.
  virtual absl::Status Fill(float* dst, float value, size_t count) = 0;
  virtual absl::Status Synchronize() = 0;
  // Device clock marks, for profiles: MarkDevice(m) notes when the device reaches this point of
  // the work issued so far (a later MarkDevice(m) replaces it); DeviceSeconds(a, b) waits until
  // the device has reached both marks and returns the device time from a to b (negative when b
  // was reached first). 0 <= m < kDeviceMarks; a mark never set is INVALID_ARGUMENT. cuda: timed
  // events on the compute stream; cpu (synchronous): the host clock at the call.
  static constexpr int kDeviceMarks = 4;
  virtual absl::Status MarkDevice(int mark) = 0;
  virtual absl::StatusOr<double> DeviceSeconds(int from, int to) = 0;
  // Progress fences, which keep the host at most a little ahead of the device (a pass with
  // breaks, pass_breaks.h): FenceDevice(f) notes the work issued so far (a later FenceDevice(f)
  // replaces it); WaitFence(f) returns once the device has done that work (at once for a fence
  // never set). 0 <= f < kDeviceFences, else INVALID_ARGUMENT. cuda: untimed events on the
  // compute stream; cpu: nothing to wait for (every op is synchronous).
  static constexpr int kDeviceFences = 2;
  virtual absl::Status FenceDevice(int fence) = 0;
  virtual absl::Status WaitFence(int fence) = 0;
  // Bytes of device memory in use by this backend's allocations, and the largest it reached.
  virtual size_t bytes_in_use() const = 0;
  virtual size_t peak_bytes_in_use() const = 0;
  // Device memory in use by the whole process as the device reports it (cuda: total − free,
  // which includes the context and library workspaces; cpu: bytes_in_use()).
  virtual absl::StatusOr<size_t> DeviceMemoryUsed() = 0;
  // Device memory the device has in all (cuda: cudaMemGetInfo's total; cpu: the host's
  // physical memory, which the cpu backend's "device" memory is).
  virtual absl::StatusOr<size_t> DeviceMemoryTotal() = 0;

  // Host memory that uploads stream from: page-locked on cuda (copies run at PCIe speed and
  // asynchronously), ordinary 64-byte-aligned memory on cpu. RESOURCE_EXHAUSTED when it cannot
  // be had. The buffer's data() is a host pointer.
  virtual absl::StatusOr<DeviceBuffer> AllocateHost(size_t bytes) = 0;

  // The upload stream (HeadInfer's ping-pong transfers). UploadAsync(p, slot) queues the copy on
  // a second stream, after the operations issued before the last ReleaseUpload(slot) have run
  // (so the destination is no longer read), and marks the slot's upload. WaitUpload(slot) makes
  // every operation issued after it wait for that upload. ReleaseUpload(slot) says that the
  // operations issued so far are the last readers of the slot's destination. The source must
  // stay unchanged until the upload has run (Synchronize waits for both streams). slot is in
  // [0, kUploadSlots). The cpu backend copies at once.
  virtual absl::Status UploadAsync(const UploadParams& p, int slot) = 0;
  virtual absl::Status WaitUpload(int slot) = 0;
  virtual absl::Status ReleaseUpload(int slot) = 0;
  virtual absl::Status RandomFill(const RandomFillParams& p) = 0;

  // Model operations (parameter structs above).
  virtual absl::Status Embed(const EmbedParams& p) = 0;
  virtual absl::Status RmsNorm(const RmsNormParams& p) = 0;
  virtual absl::Status MatMul(const MatMulParams& p) = 0;
  virtual absl::Status Rope(const RopeParams& p) = 0;
  virtual absl::Status SwiGlu(const SwiGluParams& p) = 0;
  virtual absl::Status WriteKv(const WriteKvParams& p) = 0;
  virtual absl::Status WindowAttention(const WindowAttentionParams& p) = 0;

  // Batched forms (one call per layer for all sequences of a batch): the same results as
  // calling WriteKv / WindowAttention on params[0], ..., params[count - 1] in that order. The
  // destinations of different entries must not overlap each other or another entry's inputs
  // (distinct caches; distinct o, lse and maw rows), so a backend may run the entries in any
  // order or together. Stops at the first failing entry and returns its error (the entries
  // before it may have run). The defaults call the single forms in a loop; the cuda backend
  // launches one kernel for the entries that fit its batched kernels.
  virtual absl::Status WriteKvBatch(const WriteKvParams* params, size_t count) {
    for (size_t i = 0; i < count; ++i) {
      absl::Status status = WriteKv(params[i]);
      if (!status.ok()) return status;
    }
    return absl::OkStatus();
  }
  virtual absl::Status WindowAttentionBatch(const WindowAttentionParams* params, size_t count) {
    for (size_t i = 0; i < count; ++i) {
      absl::Status status = WindowAttention(params[i]);
      if (!status.ok()) return status;
    }
    return absl::OkStatus();
  }
  virtual absl::Status MergeStates(const MergeParams& p) = 0;
  // Returns the chosen token id (waits for the result).
  virtual absl::StatusOr<int32_t> Sample(const SampleParams& p) = 0;
  virtual absl::Status TokenLogProbs(const TokenLogProbParams& p) = 0;
  // Query-aware selection (parameter structs above).
  virtual absl::Status SummarizePages(const SummarizePagesParams& p) = 0;
  virtual absl::Status SelectPages(const SelectPagesParams& p) = 0;
  virtual absl::Status KeyGram(const KeyGramParams& p) = 0;
  virtual absl::Status ProjectKeys(const ProjectKeysParams& p) = 0;
  // Batched form (one call per layer for all sequences of a micro-batch): the same results as
  // SelectPages on params[0], ..., params[count - 1] in that order. The pages and scratch of
  // different entries must not overlap each other or another entry's inputs, so a backend may
  // run the entries in any order or together. Stops at the first failing entry and returns its
  // error (the entries before it may have run). The default calls SelectPages in a loop; the
  // cuda backend scores and selects the entries of one shape (few query rows, the same heads,
  // head_dim and dtype) in one launch each.
  virtual absl::Status SelectPagesBatch(const SelectPagesParams* params, size_t count) {
    for (size_t i = 0; i < count; ++i) {
      absl::Status status = SelectPages(params[i]);
      if (!status.ok()) return status;
    }
    return absl::OkStatus();
  }
};

// The kernel that prefill chunks' window attention runs on over bf16 caches (decode steps, f32
// caches and MAW updates always keep the f32-accurate kernels).
enum class PrefillAttention {
  // FlashAttention-2-style tensor-core kernel: q and the softmax weights rounded to bf16, f32
  // accumulation. Attention outputs within ~1.5e-3 of an f64 reference (LSE 1.7e-3); top-20
  // log-probabilities of gutenberg-14m move by up to 1.8e-2 against `kExact` (BENCHMARKS.md).
  kFast,
  // q and the softmax weights split into bf16 hi + lo parts (twice the tensor-core work): outputs
  // within ~1e-6 of f64, about 2.3x the prefill attention time of `kFast` on an H100.
  kExact,
};

// "fast" or "exact"; INVALID_ARGUMENT naming the value and the choices otherwise.
inline absl::StatusOr<PrefillAttention> ParsePrefillAttention(std::string_view name) {
  if (name == "fast") return PrefillAttention::kFast;
  if (name == "exact") return PrefillAttention::kExact;
  return absl::InvalidArgumentError("prefill_attention must be fast or exact, got '" +
                                    std::string(name) + "'");
}
inline std::string_view PrefillAttentionName(PrefillAttention kernel) {
  return kernel == PrefillAttention::kExact ? "exact" : "fast";
}

// Options every backend takes; a backend ignores those it has no choice for (said per field).
struct BackendOptions {
  // cuda: picks the prefill kernel. cpu: ignored; its one attention kernel computes scores and
  // weights in f32 (the accuracy of `kExact`), so both values give the same results there.
  PrefillAttention prefill_attention = PrefillAttention::kFast;
};

// Creates the `cpu` backend. `threads` = 0: the cores this process may use.
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(unsigned threads = 0,
                                                          const BackendOptions& options = {});

// Creates the `cuda` backend on `device_ordinal`. UNAVAILABLE when this build has no CUDA
// support or no GPU is present (the message says which).
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device_ordinal = 0,
                                                           const BackendOptions& options = {});

// True when this build includes the CUDA backend (it may still find no GPU at run time).
bool CudaBackendCompiled();

}  // namespace tandem::gpu_worker
