#include "tandem/gpu_worker/model_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

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
    TANDEM_RETURN_IF_ERROR(ForwardPass({{&sequence, ids + done, count, 0}},
                                       options.targets ? options.targets + done : nullptr,
                                       options.logprobs ? options.logprobs + done : nullptr));
    done += count;
    if (options.on_chunk) options.on_chunk(done, n);
  }
  return absl::OkStatus();
}

absl::Status ModelRunner::Step(const std::vector<BatchEntry>& entries) {
  if (entries.empty()) return absl::InvalidArgumentError("a batch of no sequences");
  std::vector<Segment> segments;
  int64_t rows = 0;
  for (size_t b = 0; b < entries.size(); ++b) {
    const BatchEntry& e = entries[b];
    if (e.seq == nullptr || e.ids == nullptr || e.n < 1) {
      return absl::InvalidArgumentError(absl::StrCat("batch entry ", b, " feeds no tokens"));
    }
    for (size_t j = 0; j < b; ++j) {
      if (entries[j].seq == e.seq) return absl::InvalidArgumentError("a batch repeats a sequence");
    }
    segments.push_back({e.seq, e.ids, e.n, rows});
    rows += e.n;
  }
  if (rows > options_.max_chunk) {
    return absl::InvalidArgumentError(absl::StrCat("a batch of ", rows,
                                                   " tokens; the runner takes at most ",
                                                   options_.max_chunk));
  }
  return ForwardPass(segments, nullptr, nullptr);
}

absl::Status ModelRunner::Decode(const std::vector<Sequence*>& seqs, const int32_t* ids) {
  if (seqs.empty() || static_cast<int64_t>(seqs.size()) > options_.max_chunk) {
    return absl::InvalidArgumentError(absl::StrCat("decode batch of ", seqs.size(),
                                                   " sequences; must be 1..", options_.max_chunk));
  }
  std::vector<BatchEntry> entries;
  for (size_t b = 0; b < seqs.size(); ++b) entries.push_back({seqs[b], ids + b, 1});
  return Step(entries);
}

absl::Status ModelRunner::EnsureStreamer(const std::vector<Segment>& segments) {
  std::vector<const OffloadedKv*> kvs;
  bool any = false;
  for (const Segment& s : segments) {
    const OffloadedKv* kv =
        s.seq->mode == AttentionMode::kOffload ? s.seq->offloaded.get() : nullptr;
    if (kv != nullptr && kv->num_pages(0) == 0) kv = nullptr;
    any = any || kv != nullptr;
    kvs.push_back(kv);
  }
  if (!any) return streamer_ ? streamer_->Begin(kvs) : absl::OkStatus();
  const OffloadedKv* first = nullptr;
  for (const OffloadedKv* kv : kvs) first = first ? first : kv;
  for (const OffloadedKv* kv : kvs) {
    if (kv != nullptr && kv->page_tokens() != first->page_tokens()) {
      return absl::InvalidArgumentError("offload sequences of one pass must share a page size");
    }
  }
  if (streamer_ == nullptr) {
    TANDEM_ASSIGN_OR_RETURN(
        streamer_, KvStreamer::Create(backend_, first->geometry(), first->page_tokens(),
                                      model_.config().num_q_heads, options_.max_chunk));
  }
  return streamer_->Begin(kvs);
}

absl::Status ModelRunner::ForwardPass(const std::vector<Segment>& segments,
                                      const int32_t* targets, float* logprobs) {
  const ModelConfig& c = model_.config();
  const int64_t H = c.hidden_size, D = c.head_dim, Hq = c.num_q_heads, Hkv = c.num_kv_heads;
  const int64_t I = c.intermediate_size, V = c.vocab_size;
  const int64_t QKV = (Hq + 2 * Hkv) * D;

  // Rows, positions and window slots of every segment, stacked.
  int64_t n = 0;
  ids_host_.clear();
  positions_host_.clear();
  slots_host_.clear();
  for (const Segment& s : segments) {
    const int64_t first_pos = s.seq->window.next_position();
    TANDEM_ASSIGN_OR_RETURN(const std::vector<int32_t>* slots, s.seq->window.Append(s.n));
    slots_host_.insert(slots_host_.end(), slots->begin(), slots->end());
    for (int64_t i = 0; i < s.n; ++i) {
      positions_host_.push_back(static_cast<int32_t>(first_pos + i));
      ids_host_.push_back(s.ids[i]);
    }
    s.seq->tokens.insert(s.seq->tokens.end(), s.ids, s.ids + s.n);
    n += s.n;
  }
  TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(ids_.data(), ids_host_.data(), n * 4));
  TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(positions_.data(), positions_host_.data(), n * 4));
  TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(slots_.data(), slots_host_.data(), n * 4));
  TANDEM_RETURN_IF_ERROR(EnsureStreamer(segments));

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
    for (const Segment& s : segments) {
      WriteKvParams wk;
      wk.k = qkv + s.row0 * QKV + Hq * D;
      wk.v = qkv + s.row0 * QKV + (Hq + Hkv) * D;
      wk.row_stride = QKV;
      wk.slots = slots_.as<int32_t>() + s.row0;
      wk.k_cache = s.seq->window.k(l);
      wk.v_cache = s.seq->window.v(l);
      wk.cache_dtype = s.seq->window.geometry().dtype;
      wk.num_tokens = s.n;
      wk.num_kv_heads = Hkv;
      wk.capacity = s.seq->window.capacity();
      wk.head_dim = D;
      TANDEM_RETURN_IF_ERROR(backend_.WriteKv(wk));
    }

    TANDEM_RETURN_IF_ERROR(Attention(segments, l));

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

  // Logits: every row when log-probs are wanted (one segment); else the last row of each
  // segment, gathered into contiguous rows unless they already are (one segment, or decode).
  const bool contiguous = segments.size() == 1 || n == static_cast<int64_t>(segments.size());
  const int64_t rows = targets != nullptr ? n : (contiguous ? (segments.size() == 1 ? 1 : n)
                                                            : static_cast<int64_t>(segments.size()));
  if (rows > logits_rows_) {
    TANDEM_RETURN_IF_ERROR(AllocFloats(backend_, logits_, options_.max_chunk * V));
    logits_rows_ = options_.max_chunk;
  }
  const float* head_in = x + (n - rows) * H;
  if (targets == nullptr && !contiguous) {
    if (last_rows_.bytes() == 0) {
      TANDEM_RETURN_IF_ERROR(AllocFloats(backend_, last_rows_, options_.max_chunk * H));
    }
    for (size_t b = 0; b < segments.size(); ++b) {
      const Segment& s = segments[b];
      TANDEM_RETURN_IF_ERROR(backend_.CopyOnDevice(last_rows_.as<float>() + b * H,
                                                   x + (s.row0 + s.n - 1) * H, H * 4));
    }
    head_in = last_rows_.as<float>();
  }
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
  for (const Segment& s : segments) {
    s.seq->reselect_pending = false;
    TANDEM_RETURN_IF_ERROR(Evict(*s.seq));
  }
  ++profile_.passes;
  return absl::OkStatus();
}

WindowAttentionParams ModelRunner::WindowParams(const Segment& s, int64_t layer) const {
  const ModelConfig& c = model_.config();
  const int64_t D = c.head_dim, Hq = c.num_q_heads, Hkv = c.num_kv_heads;
  const int64_t QKV = (Hq + 2 * Hkv) * D;
  WindowAttentionParams wa;
  wa.q = qkv_.as<float>() + s.row0 * QKV;
  wa.q_row_stride = QKV;
  wa.q_pos = positions_.as<int32_t>() + s.row0;
  wa.k_cache = s.seq->window.k(layer);
  wa.v_cache = s.seq->window.v(layer);
  wa.cache_dtype = s.seq->window.geometry().dtype;
  wa.slot_pos = s.seq->window.slot_pos();
  wa.num_slots = s.seq->window.scan_slots();
  wa.capacity = s.seq->window.capacity();
  wa.num_tokens = s.n;
  wa.num_q_heads = Hq;
  wa.num_kv_heads = Hkv;
  wa.head_dim = D;
  wa.scale = 1.0f / std::sqrt(static_cast<float>(D));
  wa.o = attn_.as<float>() + s.row0 * Hq * D;
  wa.lse = lse_.as<float>() + s.row0 * Hq;
  if (s.seq->mode == AttentionMode::kHybrid) {   // MAW matters only where entries get selected
    wa.maw = s.seq->window.maw(layer);
    wa.alpha = options_.maw_alpha;
  }
  return wa;
}

absl::Status ModelRunner::Attention(const std::vector<Segment>& segments, int64_t layer) {
  const ModelConfig& c = model_.config();
  const int64_t D = c.head_dim, Hq = c.num_q_heads, Hkv = c.num_kv_heads;
  const int64_t QKV = (Hq + 2 * Hkv) * D;
  auto remote_of = [](const Segment& s) {
    return s.seq->mode == AttentionMode::kHybrid && s.seq->remote != nullptr &&
           s.seq->remote->offloaded_tokens() > 0;
  };
  // 1. q of every hybrid segment to its CPU nodes (with the pages chosen for it under
  // selection = pages); they attend while the device works.
  std::vector<bool> started(segments.size(), false);
  std::vector<bool> paged(segments.size(), false);   // attended over chosen pages this layer
  if (page_selection_.size() < segments.size()) {   // sized up front: StartAttend keeps pointers
    page_selection_.resize(segments.size());
    page_ids_host_.resize(segments.size());
  }
  absl::Status status;
  for (size_t i = 0; i < segments.size() && status.ok(); ++i) {
    const Segment& s = segments[i];
    if (!remote_of(s)) continue;
    float* q_host = q_host_.data() + s.row0 * Hq * D;
    const Clock::time_point t0 = Clock::now();
    status = backend_.CopyToHost2D(q_host, Hq * D * 4, qkv_.as<float>() + s.row0 * QKV, QKV * 4,
                                   Hq * D * 4, s.n);
    profile_.q_download_s += Seconds(t0);
    const bool pages = s.seq->selection == SelectionRule::kPages;
    // (A no-op for kPages sessions: their pages are chosen with every step's queries.)
    if (status.ok() && s.seq->reselect_pending) {
      status = s.seq->remote->Reselect(layer, q_host, s.n, s.seq->reselect_beta);
    }
    absl::StatusOr<const PageSelection*> chosen = nullptr;
    if (status.ok() && pages) {
      const Clock::time_point t1 = Clock::now();
      chosen = ChoosePages(s, i, layer);
      profile_.select_s += Seconds(t1);
      status = chosen.status();
    }
    if (status.ok()) status = s.seq->remote->StartAttend(layer, q_host, s.n, *chosen);
    started[i] = status.ok();
    paged[i] = status.ok() && *chosen != nullptr;
  }
  // 2. The window of every segment on the device; offload segments stream their host pages.
  for (size_t i = 0; i < segments.size() && status.ok(); ++i) {
    const WindowAttentionParams wa = WindowParams(segments[i], layer);
    status = backend_.WindowAttention(wa);
    if (status.ok() && segments[i].seq->mode == AttentionMode::kOffload && streamer_ != nullptr) {
      status = streamer_->AttendLayer(layer, i, wa);
    }
  }
  // 3. Join every CPU part (always, even after an error, so no call outlives this step), merge.
  for (size_t i = 0; i < segments.size(); ++i) {
    if (!started[i]) continue;
    const Segment& s = segments[i];
    float* o_host = o_host_.data() + s.row0 * Hq * D;
    float* lse_host = lse_host_.data() + s.row0 * Hq;
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<bool> degraded = s.seq->remote->FinishAttend(o_host, lse_host);
    profile_.cpu_wait_s += Seconds(t0);
    if (!status.ok()) continue;
    if (!degraded.ok()) {
      status = degraded.status();
      continue;
    }
    if (*degraded) ++s.seq->degraded_steps;
    if (options_.measure_captured_mass && s.seq->selection == SelectionRule::kPages) {
      status = MeasureCapturedMass(s, layer, paged[i], lse_host);
      if (!status.ok()) continue;
    }
    const Clock::time_point t1 = Clock::now();
    float* cpu_o = cpu_o_.as<float>() + s.row0 * Hq * D;
    float* cpu_lse = cpu_lse_.as<float>() + s.row0 * Hq;
    status = backend_.CopyToDevice(cpu_o, o_host, s.n * Hq * D * 4);
    if (status.ok()) status = backend_.CopyToDevice(cpu_lse, lse_host, s.n * Hq * 4);
    if (status.ok()) {
      status = backend_.MergeStates({attn_.as<float>() + s.row0 * Hq * D,
                                     lse_.as<float>() + s.row0 * Hq, cpu_o, cpu_lse, s.n * Hq,
                                     D});
    }
    profile_.merge_upload_s += Seconds(t1);
  }
  return status;
}

absl::Status ModelRunner::MeasureCapturedMass(const Segment& s, int64_t layer, bool paged,
                                              const float* selected_lse) {
  const int64_t Hq = model_.config().num_q_heads, D = model_.config().head_dim;
  CapturedMass& mass = s.seq->captured_mass;
  if (mass.sum.empty()) {
    mass.sum.assign(model_.config().num_layers, 0.0);
    mass.count.assign(model_.config().num_layers, 0);
  }
  if (!paged) {   // everything was attended: all of the mass
    mass.sum[layer] += static_cast<double>(s.n * Hq);
    mass.count[layer] += static_cast<uint64_t>(s.n * Hq);
    return absl::OkStatus();
  }
  // The same queries over every offloaded entry: the denominator of the captured share.
  dense_o_host_.resize(static_cast<size_t>(s.n) * Hq * D);
  dense_lse_host_.resize(static_cast<size_t>(s.n) * Hq);
  TANDEM_RETURN_IF_ERROR(
      s.seq->remote->StartAttend(layer, q_host_.data() + s.row0 * Hq * D, s.n, nullptr));
  TANDEM_ASSIGN_OR_RETURN(const bool degraded,
                          s.seq->remote->FinishAttend(dense_o_host_.data(), dense_lse_host_.data()));
  if (degraded) return absl::OkStatus();   // nothing to compare against this step
  for (int64_t r = 0; r < s.n * Hq; ++r) {
    if (!std::isfinite(dense_lse_host_[r])) continue;
    const double share = std::isfinite(selected_lse[r])
                             ? std::exp(static_cast<double>(selected_lse[r]) - dense_lse_host_[r])
                             : 0.0;
    mass.sum[layer] += std::min(share, 1.0);
    mass.count[layer] += 1;
  }
  return absl::OkStatus();
}

absl::StatusOr<const PageSelection*> ModelRunner::ChoosePages(const Segment& s, size_t index,
                                                              int64_t layer) {
  const ModelConfig& c = model_.config();
  const int64_t Hq = c.num_q_heads, Hkv = c.num_kv_heads;
  const int64_t QKV = (Hq + 2 * Hkv) * c.head_dim;
  const PageIndex* index_of_seq = s.seq->pages.get();
  if (index_of_seq == nullptr) {
    return absl::FailedPreconditionError("pages selection without a page index");
  }
  const PagePolicy& policy = s.seq->page_policy;
  const int64_t num_pages = index_of_seq->num_pages(layer);
  const int64_t per_head =
      std::max<int64_t>(1, policy.select_tokens / index_of_seq->page_tokens());
  // Dense layers and budgets that cover every page attend over everything (exact): no ids.
  if (layer < policy.dense_layers || per_head >= num_pages) return nullptr;

  const size_t ids = static_cast<size_t>(s.n) * Hkv * per_head;
  if (selected_pages_.bytes() < ids * 4) {
    TANDEM_ASSIGN_OR_RETURN(selected_pages_, backend_.Allocate(ids * 4));
  }
  // Query rows per SelectPages call so that its scores stay within kMaxSelectScratchBytes
  // (a long prefill chunk over a long context is cut into several calls).
  const size_t row_bytes = SelectPagesScratchBytes(1, Hkv, num_pages);
  const int64_t rows_per_call = std::clamp<int64_t>(
      static_cast<int64_t>(kMaxSelectScratchBytes / row_bytes), 1, s.n);
  const size_t scratch = SelectPagesScratchBytes(rows_per_call, Hkv, num_pages);
  if (select_scratch_.bytes() < scratch) {
    select_scratch_.Reset();
    TANDEM_ASSIGN_OR_RETURN(select_scratch_, backend_.Allocate(scratch));
  }
  for (int64_t r = 0; r < s.n; r += rows_per_call) {
    const int64_t rows = std::min(rows_per_call, s.n - r);
    TANDEM_RETURN_IF_ERROR(index_of_seq->Select(
        layer, qkv_.as<float>() + (s.row0 + r) * QKV, QKV, rows, Hq, per_head,
        selected_pages_.as<int32_t>() + r * Hkv * per_head, select_scratch_.data()));
  }
  std::vector<int32_t>& host = page_ids_host_[index];
  host.resize(ids);
  TANDEM_RETURN_IF_ERROR(backend_.CopyToHost(host.data(), selected_pages_.data(), ids * 4));
  page_selection_[index] = PageSelection{host.data(), per_head};
  return &page_selection_[index];
}

absl::Status ModelRunner::Evict(Sequence& seq) {
  const std::vector<EvictedBlock> blocks = seq.window.PendingEvictions();
  if (blocks.empty()) return absl::OkStatus();
  const bool offload = seq.mode == AttentionMode::kOffload && seq.offloaded != nullptr;
  if (seq.remote == nullptr && !offload) {
    return absl::FailedPreconditionError("window eviction without CPU nodes or host memory");
  }
  if (seq.pages != nullptr) TANDEM_RETURN_IF_ERROR(seq.pages->AppendEvicted(seq.window, blocks));
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
    if (offload) {
      TANDEM_RETURN_IF_ERROR(
          seq.offloaded->Append(l, evict_k_.data(), evict_v_.data(), total));
    } else {
      TANDEM_RETURN_IF_ERROR(seq.remote->Append(l, evict_k_.data(), evict_v_.data(),
                                                evict_maw_.data(), total, window_entries));
    }
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
