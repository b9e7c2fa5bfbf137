#include "tandem/gpu_worker/model_runner.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {
namespace {

absl::Status AllocFloats(Backend& backend, DeviceBuffer& buffer, int64_t count) {
  TANDEM_ASSIGN_OR_RETURN(buffer, backend.Allocate(static_cast<size_t>(count) * 4));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(Backend& backend,
                                                                 const DeviceModel& model,
                                                                 const RunnerOptions& options) {
  if (options.max_chunk < 1 || options.max_chunk > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill chunk must be in 1..65536 tokens, got ", options.max_chunk));
  }
  if (!(options.maw_alpha > 0.0f && options.maw_alpha <= 1.0f)) {
    return absl::InvalidArgumentError("MAW alpha must be in (0, 1]");
  }
  auto runner = std::unique_ptr<ModelRunner>(new ModelRunner(backend, model, options));
  const ModelConfig& c = model.config();
  const int64_t C = options.max_chunk, H = c.hidden_size, D = c.head_dim;
  const int64_t Hq = c.num_q_heads, Hkv = c.num_kv_heads, I = c.intermediate_size;
  ModelRunner& r = *runner;
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, r.x_, C * H));
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, r.xn_, C * H));
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, r.qkv_, C * (Hq + 2 * Hkv) * D));
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, r.attn_, C * Hq * D));
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, r.lse_, C * Hq));
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, r.cpu_o_, C * Hq * D));
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, r.cpu_lse_, C * Hq));
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, r.gate_up_, C * 2 * I));
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, r.ffn_, C * I));
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, r.ids_, C));
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, r.positions_, C));
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, r.slots_, C));
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, r.targets_, C));
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, r.logprobs_, C));
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, r.logits_, c.vocab_size));
  r.logits_rows_ = 1;
  r.q_host_.resize(C * Hq * D);
  r.o_host_.resize(C * Hq * D);
  r.lse_host_.resize(C * Hq);
  return runner;
}

absl::Status ModelRunner::Forward(Sequence& sequence, const int32_t* ids, int64_t n,
                                  const ForwardOptions& options) {
  if (n <= 0) return absl::InvalidArgumentError("forward of zero tokens");
  if (options.targets != nullptr && options.logprobs == nullptr) {
    return absl::InvalidArgumentError("targets need a logprobs output");
  }
  for (int64_t done = 0; done < n;) {
    const int64_t count = std::min(options_.max_chunk, n - done);
    TANDEM_RETURN_IF_ERROR(ForwardChunk(
        sequence, ids + done, count, options.targets ? options.targets + done : nullptr,
        options.logprobs ? options.logprobs + done : nullptr));
    done += count;
    if (options.on_chunk) options.on_chunk(done, n);
  }
  return absl::OkStatus();
}

absl::Status ModelRunner::ForwardChunk(Sequence& seq, const int32_t* ids, int64_t n,
                                       const int32_t* targets, float* logprobs) {
  const ModelConfig& c = model_.config();
  const int64_t H = c.hidden_size, D = c.head_dim, Hq = c.num_q_heads, Hkv = c.num_kv_heads;
  const int64_t I = c.intermediate_size, V = c.vocab_size;
  const int64_t QKV = (Hq + 2 * Hkv) * D;

  const int64_t first_pos = seq.window.next_position();
  TANDEM_ASSIGN_OR_RETURN(const std::vector<int32_t>* slots, seq.window.Append(n));
  std::vector<int32_t> positions(n);
  std::iota(positions.begin(), positions.end(), static_cast<int32_t>(first_pos));
  TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(ids_.data(), ids, n * 4));
  TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(positions_.data(), positions.data(), n * 4));
  TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(slots_.data(), slots->data(), n * 4));
  seq.tokens.insert(seq.tokens.end(), ids, ids + n);

  float* x = x_.as<float>();
  float* xn = xn_.as<float>();
  float* qkv = qkv_.as<float>();
  TANDEM_RETURN_IF_ERROR(backend_.Embed({ids_.as<int32_t>(), model_.embed().data(),
                                         model_.embed().dtype, x, n, H, V}));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const DeviceLayer& w = model_.layer(l);
    TANDEM_RETURN_IF_ERROR(backend_.RmsNorm(
        {x, w.attn_norm.data(), w.attn_norm.dtype, xn, n, H, static_cast<float>(c.rms_norm_eps)}));
    MatMulParams mm;
    mm.x = xn;
    mm.w = w.qkv.data();
    mm.w_dtype = w.qkv.dtype;
    mm.bias = w.qkv_bias.buffer ? w.qkv_bias.buffer.as<float>() : nullptr;
    mm.y = qkv;
    mm.m = n;
    mm.n = QKV;
    mm.k = H;
    TANDEM_RETURN_IF_ERROR(backend_.MatMul(mm));
    RopeParams rope;
    rope.row_stride = QKV;
    rope.positions = positions_.as<int32_t>();
    rope.inv_freq = model_.inv_freq();
    rope.num_tokens = n;
    rope.head_dim = D;
    rope.x = qkv;
    rope.num_heads = Hq;
    TANDEM_RETURN_IF_ERROR(backend_.Rope(rope));
    rope.x = qkv + Hq * D;
    rope.num_heads = Hkv;
    TANDEM_RETURN_IF_ERROR(backend_.Rope(rope));
    WriteKvParams wk;
    wk.k = qkv + Hq * D;
    wk.v = qkv + (Hq + Hkv) * D;
    wk.row_stride = QKV;
    wk.slots = slots_.as<int32_t>();
    wk.k_cache = seq.window.k(l);
    wk.v_cache = seq.window.v(l);
    wk.cache_dtype = seq.window.geometry().dtype;
    wk.num_tokens = n;
    wk.num_kv_heads = Hkv;
    wk.capacity = seq.window.capacity();
    wk.head_dim = D;
    TANDEM_RETURN_IF_ERROR(backend_.WriteKv(wk));

    TANDEM_RETURN_IF_ERROR(Attention(seq, l, n));

    mm = {};
    mm.x = attn_.as<float>();
    mm.w = w.o_proj.data();
    mm.w_dtype = w.o_proj.dtype;
    mm.y = x;
    mm.m = n;
    mm.n = H;
    mm.k = Hq * D;
    mm.accumulate = true;   // the residual add
    TANDEM_RETURN_IF_ERROR(backend_.MatMul(mm));
    TANDEM_RETURN_IF_ERROR(backend_.RmsNorm(
        {x, w.ffn_norm.data(), w.ffn_norm.dtype, xn, n, H, static_cast<float>(c.rms_norm_eps)}));
    mm = {};
    mm.x = xn;
    mm.w = w.gate_up.data();
    mm.w_dtype = w.gate_up.dtype;
    mm.y = gate_up_.as<float>();
    mm.m = n;
    mm.n = 2 * I;
    mm.k = H;
    TANDEM_RETURN_IF_ERROR(backend_.MatMul(mm));
    TANDEM_RETURN_IF_ERROR(backend_.SwiGlu({gate_up_.as<float>(), ffn_.as<float>(), n, I}));
    mm = {};
    mm.x = ffn_.as<float>();
    mm.w = w.down_proj.data();
    mm.w_dtype = w.down_proj.dtype;
    mm.y = x;
    mm.m = n;
    mm.n = H;
    mm.k = I;
    mm.accumulate = true;
    TANDEM_RETURN_IF_ERROR(backend_.MatMul(mm));
  }

  // Logits: every row when log-probs are wanted, else only the last token's.
  const int64_t rows = targets != nullptr ? n : 1;
  if (rows > logits_rows_) {
    TANDEM_RETURN_IF_ERROR(AllocFloats(backend_, logits_, options_.max_chunk * V));
    logits_rows_ = options_.max_chunk;
  }
  const float* head_in = x + (n - rows) * H;
  TANDEM_RETURN_IF_ERROR(backend_.RmsNorm({head_in, model_.final_norm().data(),
                                           model_.final_norm().dtype, xn, rows, H,
                                           static_cast<float>(c.rms_norm_eps)}));
  MatMulParams head;
  head.x = xn;
  head.w = model_.lm_head();
  head.w_dtype = model_.lm_head_dtype();
  head.y = logits_.as<float>();
  head.m = rows;
  head.n = V;
  head.k = H;
  TANDEM_RETURN_IF_ERROR(backend_.MatMul(head));
  last_logits_ = logits_.as<float>() + (rows - 1) * V;
  if (targets != nullptr) {
    std::vector<int32_t> safe(targets, targets + n);
    for (int32_t& t : safe) t = (t >= 0 && t < V) ? t : 0;
    TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(targets_.data(), safe.data(), n * 4));
    TANDEM_RETURN_IF_ERROR(backend_.TokenLogProbs(
        {logits_.as<float>(), targets_.as<int32_t>(), logprobs_.as<float>(), n, V}));
    TANDEM_RETURN_IF_ERROR(backend_.CopyToHost(logprobs, logprobs_.data(), n * 4));
    for (int64_t i = 0; i < n; ++i) {
      if (targets[i] < 0 || targets[i] >= V) logprobs[i] = 0.0f;
    }
  }
  seq.reselect_pending = false;
  return Evict(seq);
}

absl::Status ModelRunner::Attention(Sequence& seq, int64_t layer, int64_t n) {
  const ModelConfig& c = model_.config();
  const int64_t D = c.head_dim, Hq = c.num_q_heads, Hkv = c.num_kv_heads;
  const int64_t QKV = (Hq + 2 * Hkv) * D;
  const bool hybrid = seq.mode == AttentionMode::kHybrid;
  const bool remote = hybrid && seq.remote != nullptr && seq.remote->offloaded_tokens() > 0;
  if (remote) {
    // q of this chunk to the CPU nodes; they attend while the device does the window.
    TANDEM_RETURN_IF_ERROR(backend_.CopyToHost2D(q_host_.data(), Hq * D * 4, qkv_.data(),
                                                 QKV * 4, Hq * D * 4, n));
    if (seq.reselect_pending) {
      TANDEM_RETURN_IF_ERROR(seq.remote->Reselect(layer, q_host_.data(), n, seq.reselect_beta));
    }
    TANDEM_RETURN_IF_ERROR(seq.remote->StartAttend(layer, q_host_.data(), n));
  }
  WindowAttentionParams wa;
  wa.q = qkv_.as<float>();
  wa.q_row_stride = QKV;
  wa.q_pos = positions_.as<int32_t>();
  wa.k_cache = seq.window.k(layer);
  wa.v_cache = seq.window.v(layer);
  wa.cache_dtype = seq.window.geometry().dtype;
  wa.slot_pos = seq.window.slot_pos();
  wa.num_slots = seq.window.scan_slots();
  wa.capacity = seq.window.capacity();
  wa.num_tokens = n;
  wa.num_q_heads = Hq;
  wa.num_kv_heads = Hkv;
  wa.head_dim = D;
  wa.scale = 1.0f / std::sqrt(static_cast<float>(D));
  wa.o = attn_.as<float>();
  wa.lse = lse_.as<float>();
  if (hybrid) {   // MAW matters only where entries get evicted
    wa.maw = seq.window.maw(layer);
    wa.alpha = options_.maw_alpha;
  }
  const absl::Status window_status = backend_.WindowAttention(wa);
  if (!remote) return window_status;
  // Always join the CPU side, even when the window failed, so no call outlives this step.
  absl::StatusOr<bool> degraded = seq.remote->FinishAttend(o_host_.data(), lse_host_.data());
  TANDEM_RETURN_IF_ERROR(window_status);
  TANDEM_RETURN_IF_ERROR(degraded.status());
  if (*degraded) ++seq.degraded_steps;
  TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(cpu_o_.data(), o_host_.data(), n * Hq * D * 4));
  TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(cpu_lse_.data(), lse_host_.data(), n * Hq * 4));
  return backend_.MergeStates({attn_.as<float>(), lse_.as<float>(), cpu_o_.as<float>(),
                               cpu_lse_.as<float>(), n * Hq, D});
}

absl::Status ModelRunner::Evict(Sequence& seq) {
  const std::vector<EvictedBlock> blocks = seq.window.PendingEvictions();
  if (blocks.empty()) return absl::OkStatus();
  if (seq.remote == nullptr) {
    return absl::FailedPreconditionError("window eviction without CPU nodes");
  }
  const WindowGeometry& g = seq.window.geometry();
  int64_t total = 0;
  for (const EvictedBlock& b : blocks) total += b.count;
  const size_t kv_bytes = g.num_kv_heads * total * g.head_dim * DTypeBytes(g.dtype);
  evict_k_.resize(kv_bytes);
  evict_v_.resize(kv_bytes);
  evict_maw_.resize(g.num_kv_heads * total);
  // n_gpu of the selection threshold: the entries on the device when these leave it.
  const int64_t window_entries = seq.window.entries();
  for (int64_t l = 0; l < g.num_layers; ++l) {
    TANDEM_RETURN_IF_ERROR(
        seq.window.ReadBlocks(l, blocks, evict_k_.data(), evict_v_.data(), evict_maw_.data()));
    TANDEM_RETURN_IF_ERROR(seq.remote->Append(l, evict_k_.data(), evict_v_.data(),
                                              evict_maw_.data(), total, window_entries));
  }
  return seq.window.Release(blocks);
}

absl::StatusOr<std::vector<float>> ModelRunner::LastLogitsToHost() {
  if (last_logits_ == nullptr) return absl::FailedPreconditionError("no forward pass yet");
  std::vector<float> logits(model_.config().vocab_size);
  TANDEM_RETURN_IF_ERROR(backend_.CopyToHost(logits.data(), last_logits_, logits.size() * 4));
  return logits;
}

}  // namespace tandem::gpu_worker
