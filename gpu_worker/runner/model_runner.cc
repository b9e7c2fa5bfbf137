#include "tandem/gpu_worker/model_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "device_layer_clock.h"
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

ModelRunner::ModelRunner(Backend& backend, const DeviceModel& model, const RunnerOptions& options)
    : backend_(backend),
      model_(model),
      options_(options),
      tiers_(backend, model.config().num_q_heads, options.max_chunk,
             options.measure_captured_mass),
      layer_clock_(std::make_unique<DeviceLayerClock>(backend)) {}

ModelRunner::~ModelRunner() = default;

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
  if (options.settle_tokens_per_step < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "settle_tokens_per_step must be >= 0, got ", options.settle_tokens_per_step));
  }
  if (options.micro_batches != 1 && options.micro_batches != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro_batches must be 1 or 2, got ", options.micro_batches));
  }
  auto runner = std::unique_ptr<ModelRunner>(new ModelRunner(backend, model, options));
  const ModelConfig& c = model.config();
  const int64_t C = options.max_chunk, Hq = c.num_q_heads, D = c.head_dim;
  Activations& a = runner->act_;
  for (const auto& [buffer, count] : ActivationBuffers(c, options)) {
    TANDEM_RETURN_IF_ERROR(AllocFloats(backend, a.*buffer, count));
  }
  TANDEM_RETURN_IF_ERROR(AllocFloats(backend, runner->logits_, c.vocab_size));
  runner->logits_rows_ = 1;
  a.q_host.resize(C * Hq * D);
  a.o_host.resize(C * Hq * D);
  a.lse_host.resize(C * Hq);
  return runner;
}

ModelRunner::ActivationTable ModelRunner::ActivationBuffers(const ModelConfig& c,
                                                           const RunnerOptions& options) {
  const int64_t C = options.max_chunk;
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.intermediate_size;
  const int64_t Hq = c.num_q_heads, Hkv = c.num_kv_heads;
  ActivationTable table = {
      {&Activations::x, C * H},           {&Activations::xn, C * H},
      {&Activations::qkv, C * (Hq + 2 * Hkv) * D},
      {&Activations::attn, C * Hq * D},   {&Activations::lse, C * Hq},
      {&Activations::part_o, C * Hq * D}, {&Activations::part_lse, C * Hq},
      {&Activations::gate_up, C * 2 * I}, {&Activations::ffn, C * I},
      {&Activations::ids, C},             {&Activations::positions, C},
      {&Activations::slots, C},           {&Activations::targets, C},
      {&Activations::logprobs, C}};
  if (RopeDependsOnLength(c)) table.push_back({&Activations::rope_inv_freq, C * (D / 2)});
  if (options.speculate_pages) {
    table.push_back({&Activations::q_guess, C * Hq * D});
    table.push_back({&Activations::xn_guess, C * H});
  }
  if (options.pass_breaks) table.push_back({&Activations::parked_x, C * H});
  return table;
}

size_t ModelRunner::ActivationBytes(const ModelConfig& c, const RunnerOptions& options,
                                    bool batched) {
  int64_t floats = 0;
  for (const auto& [buffer, count] : ActivationBuffers(c, options)) floats += count;
  // logits_: one row from Create; a batched pass (Logits) replaces it by max_chunk rows and
  // may gather the segments' last rows into last_rows_.
  floats += batched ? options.max_chunk * (c.vocab_size + c.hidden_size) : c.vocab_size;
  return static_cast<size_t>(floats) * 4;
}

absl::Status ModelRunner::SetMicroBatches(int micro_batches) {
  if (micro_batches != 1 && micro_batches != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro_batches must be 1 or 2, got ", micro_batches));
  }
  options_.micro_batches = micro_batches;
  return absl::OkStatus();
}

void ModelRunner::ResetProfile() {
  profile_ = {};
  tiers_.profile() = {};
}

absl::Status ModelRunner::Forward(Sequence& sequence, const int32_t* ids, int64_t n,
                                  const ForwardOptions& options) {
  if (n <= 0) return absl::InvalidArgumentError("forward of zero tokens");
  if (options.targets != nullptr && options.logprobs == nullptr) {
    return absl::InvalidArgumentError("targets need a logprobs output");
  }
  for (int64_t done = 0; done < n;) {
    const int64_t count = std::min(options_.max_chunk, n - done);
    Segment segment;
    segment.seq = &sequence;
    segment.ids = ids + done;
    segment.n = count;
    TANDEM_RETURN_IF_ERROR(ForwardPass({segment},
                                       options.targets ? options.targets + done : nullptr,
                                       options.logprobs ? options.logprobs + done : nullptr));
    done += count;
    if (options.on_chunk) options.on_chunk(done, n);
  }
  return absl::OkStatus();
}

absl::Status ModelRunner::Step(const std::vector<BatchEntry>& entries, PassBreaks* breaks) {
  if (entries.empty()) return absl::InvalidArgumentError("a batch of no sequences");
  if (breaks != nullptr && !options_.pass_breaks) {
    return absl::InvalidArgumentError("a pass with breaks needs RunnerOptions::pass_breaks");
  }
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
    Segment segment;
    segment.seq = e.seq;
    segment.ids = e.ids;
    segment.n = e.n;
    segment.entry = b;
    segments.push_back(segment);
    rows += e.n;
  }
  if (rows > options_.max_chunk) {
    return absl::InvalidArgumentError(absl::StrCat("a batch of ", rows,
                                                   " tokens; the runner takes at most ",
                                                   options_.max_chunk));
  }
  return ForwardPass(std::move(segments), nullptr, nullptr, in_interlude_ ? nullptr : breaks);
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

std::vector<ModelRunner::MicroBatch> ModelRunner::Split(std::vector<Segment>& segments) const {
  // Off-device work of each segment: its rows times its tier's work per row.
  std::vector<double> work(segments.size(), 0.0);
  size_t off_device = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (s.attends) work[i] = s.seq->offload->off_device_work() * static_cast<double>(s.n);
    if (work[i] > 0) ++off_device;
  }
  std::vector<int> side(segments.size(), 0);
  double share = options_.split_min_scan_share;
  if (share < 0) {
    share = backend_.name() == "cpu" ? std::numeric_limits<double>::infinity() : 1.0 / 64;
  }
  const double total = std::accumulate(work.begin(), work.end(), 0.0);
  const bool split = options_.micro_batches >= 2 && off_device >= 2 &&
                     total >= share * static_cast<double>(model_.weight_bytes()) &&
                     total >= options_.split_min_scan_bytes;
  if (split) {
    // Longest processing time first: each segment with CPU work joins the micro-batch with
    // less so far.
    std::vector<size_t> order(segments.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return work[a] > work[b]; });
    double load[2] = {0.0, 0.0};
    for (size_t i : order) {
      if (work[i] <= 0) continue;
      side[i] = load[1] < load[0] ? 1 : 0;
      load[side[i]] += work[i];
    }
    // Device-only segments join the micro-batch with less CPU work: their device time then
    // hides the other one's larger CPU time.
    const int lighter = load[1] < load[0] ? 1 : 0;
    for (size_t i = 0; i < segments.size(); ++i) {
      if (work[i] <= 0) side[i] = lighter;
    }
  }
  // Micro-batch 0's segments first; within each, those with off-device work first (their rows
  // are then adjacent, so their q downloads and merges coalesce), each group in entry order.
  // Rows follow that order.
  std::vector<Segment> ordered;
  std::vector<MicroBatch> batches;
  int64_t row = 0;
  for (int m = 0; m < (split ? 2 : 1); ++m) {
    MicroBatch mb;
    mb.first = ordered.size();
    mb.row0 = row;
    for (const bool off : {true, false}) {
      for (size_t i = 0; i < segments.size(); ++i) {
        if (side[i] != m || (work[i] > 0) != off) continue;
        ordered.push_back(segments[i]);
        ordered.back().row0 = row;
        row += segments[i].n;
      }
    }
    mb.count = ordered.size() - mb.first;
    mb.rows = row - mb.row0;
    batches.push_back(mb);
  }
  segments = std::move(ordered);
  return batches;
}

absl::Status ModelRunner::ForwardPass(std::vector<Segment> segments, const int32_t* targets,
                                      float* logprobs, PassBreaks* breaks) {
  const Clock::time_point start = Clock::now();
  const double interludes_before = profile_.interlude_s;
  const ModelConfig& c = model_.config();
  for (Segment& s : segments) s.seq->in_pass = true;
  absl::Cleanup pass_over = [&segments] {
    for (Segment& s : segments) s.seq->in_pass = false;
  };
  for (Segment& s : segments) {
    // A settling sequence (a narrowed prefill's blocks still on the device) keeps them in its
    // window; only those whose ring slots this pass's tokens take leave first.
    TANDEM_RETURN_IF_ERROR(EvictBlocks(*s.seq, s.seq->window.EvictionsBeforeAppend(s.n)));
    s.attends = s.seq->offload != nullptr && s.seq->offload->offloaded_tokens() > 0;
  }
  const std::vector<MicroBatch> batches = Split(segments);

  // Rows, positions and window slots of every segment, stacked in pass order.
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
  TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(act_.ids.data(), ids_host_.data(), n * 4));
  TANDEM_RETURN_IF_ERROR(
      backend_.CopyToDevice(act_.positions.data(), positions_host_.data(), n * 4));
  TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(act_.slots.data(), slots_host_.data(), n * 4));
  TANDEM_RETURN_IF_ERROR(PrepareRope(segments, n));
  tiers_.BeginPass(segments.size());
  for (size_t i = 0; i < segments.size(); ++i) {
    if (segments[i].attends) TANDEM_RETURN_IF_ERROR(segments[i].seq->offload->BeginPass(tiers_, i));
  }
  TANDEM_RETURN_IF_ERROR(tiers_.StartPass());

  TANDEM_RETURN_IF_ERROR(backend_.Embed({act_.ids.as<int32_t>(), model_.embed().data(),
                                         model_.embed().dtype, act_.x.as<float>(), n,
                                         c.hidden_size, c.vocab_size}));
  if (targets != nullptr || !TakesBreaks(segments, batches)) breaks = nullptr;
  absl::Status status = Layers(segments, batches, breaks);
  if (status.ok()) status = Logits(segments, n, targets, logprobs);
  for (size_t i = 0; i < segments.size() && status.ok(); ++i) {
    Sequence& seq = *segments[i].seq;
    seq.reselect_pending = false;
    if (seq.window.widened() && seq.window.next_position() >= seq.prefill_end) {
      // The prompt is in: back to the configured window. The blocks beyond it leave later, a
      // slice per step (SettleSlice), so neither the first token nor later steps wait for them.
      status = seq.window.Narrow();
    } else if (!seq.window.settling()) {
      status = Evict(seq);
    }
  }
  static_cast<OffloadProfile&>(profile_) = tiers_.profile();
  profile_.pass_s += Seconds(start) - (profile_.interlude_s - interludes_before);
  ++profile_.passes;
  if (batches.size() > 1) ++profile_.split_passes;
  return status;
}

absl::Status ModelRunner::PrepareRope(const std::vector<Segment>& segments, int64_t rows) {
  rope_per_row_ = false;
  const ModelConfig& c = model_.config();
  if (!RopeDependsOnLength(c)) return absl::OkStatus();
  // Segments are stacked in pass order; a segment's rows end at its sequence's new length.
  bool any_long = false;
  for (const Segment& s : segments) {
    any_long |= s.seq->window.next_position() > c.max_position_embeddings;
  }
  if (!any_long) return absl::OkStatus();
  const size_t half = static_cast<size_t>(c.head_dim / 2);
  rope_inv_freq_host_.resize(static_cast<size_t>(rows) * half);
  float* dst = rope_inv_freq_host_.data();
  for (const Segment& s : segments) {
    const std::vector<float> inv_freq = RopeInvFreq(c, s.seq->window.next_position());
    for (int64_t i = 0; i < s.n; ++i, dst += half) std::copy(inv_freq.begin(), inv_freq.end(), dst);
  }
  TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(
      act_.rope_inv_freq.data(), rope_inv_freq_host_.data(), rope_inv_freq_host_.size() * 4));
  rope_per_row_ = true;
  return absl::OkStatus();
}

bool ModelRunner::AttendsOffDevice(const Sequence& seq) {
  // A tier with entries attends in every layer; one that keeps layer inputs takes them in each.
  return seq.offload != nullptr &&
         (seq.offload->offloaded_tokens() > 0 || seq.offload->wants_layer_inputs());
}

bool ModelRunner::CanBreak(const std::vector<Sequence*>& sequences) const {
  if (!options_.pass_breaks || options_.device_marks || in_interlude_) return false;
  for (const Sequence* seq : sequences) {
    if (AttendsOffDevice(*seq)) return false;
  }
  return true;
}

bool ModelRunner::TakesBreaks(const std::vector<Segment>& segments,
                              const std::vector<MicroBatch>& batches) const {
  if (batches.size() != 1 || options_.device_marks) return false;
  for (const Segment& s : segments) {
    if (s.attends || AttendsOffDevice(*s.seq)) return false;
  }
  return true;
}

absl::Status ModelRunner::LayerBoundary(int64_t layer, int64_t rows, PassBreaks& breaks) {
  // Fences alternate: after layer l's tail is queued, wait for layer l-1's. The device then
  // still has layer l to run while the host queues layer l+1, and an interlude starts after at
  // most about one layer of this pass.
  const int fence = static_cast<int>(layer % Backend::kDeviceFences);
  TANDEM_RETURN_IF_ERROR(backend_.FenceDevice(fence));
  TANDEM_RETURN_IF_ERROR(backend_.WaitFence((fence + 1) % Backend::kDeviceFences));
  if (!breaks.Due()) return absl::OkStatus();
  const int64_t H = model_.config().hidden_size;
  const size_t x_bytes = static_cast<size_t>(rows * H) * 4;
  TANDEM_RETURN_IF_ERROR(backend_.CopyOnDevice(act_.parked_x.data(), act_.x.data(), x_bytes));
  // What the interlude's passes overwrite and the following layers read: the per-row host
  // state (the device copies are uploaded again from it) and the per-segment attend state.
  std::vector<int32_t> positions, slots;
  std::vector<float> rope_inv_freq;
  std::vector<AttendRows> attends;
  std::vector<char> started;
  const bool rope_per_row = rope_per_row_;
  positions.swap(positions_host_);
  slots.swap(slots_host_);
  rope_inv_freq.swap(rope_inv_freq_host_);
  attends.swap(attends_);
  started.swap(started_);
  const Clock::time_point t0 = Clock::now();
  in_interlude_ = true;
  breaks.Interlude();
  in_interlude_ = false;
  profile_.interlude_s += Seconds(t0);
  ++profile_.pass_breaks;
  positions.swap(positions_host_);
  slots.swap(slots_host_);
  rope_inv_freq.swap(rope_inv_freq_host_);
  attends.swap(attends_);
  started.swap(started_);
  rope_per_row_ = rope_per_row;
  TANDEM_RETURN_IF_ERROR(backend_.CopyOnDevice(act_.x.data(), act_.parked_x.data(), x_bytes));
  TANDEM_RETURN_IF_ERROR(
      backend_.CopyToDevice(act_.positions.data(), positions_host_.data(), rows * 4));
  TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(act_.slots.data(), slots_host_.data(), rows * 4));
  if (rope_per_row_) {
    TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(act_.rope_inv_freq.data(),
                                                 rope_inv_freq_host_.data(),
                                                 rope_inv_freq_host_.size() * 4));
  }
  return absl::OkStatus();
}

absl::Status ModelRunner::Layers(std::vector<Segment>& segments,
                                 const std::vector<MicroBatch>& batches, PassBreaks* breaks) {
  attends_.assign(segments.size(), AttendRows{});
  started_.assign(segments.size(), 0);
  const int64_t layers = model_.config().num_layers;
  layer_clock_->Start(options_.device_marks && batches.size() == 1);
  absl::Status status;
  // One micro-batch: head(0) tail(0) head(1) tail(1) ... Two: both heads of layer 0, then
  // tail(A,l) head(A,l+1) tail(B,l) head(B,l+1): while the host waits for A's CPU nodes in
  // tail(A,l), the device still runs B's head; while B's nodes attend, A's tail and next head.
  for (size_t m = 0; m < batches.size() && status.ok(); ++m) {
    status = LayerHead(segments, batches[m], 0);
  }
  for (int64_t l = 0; l < layers && status.ok(); ++l) {
    for (size_t m = 0; m < batches.size() && status.ok(); ++m) {
      status = LayerTail(segments, batches[m], l);
      // A break (one micro-batch, nothing off the device): only x carries into layer l+1.
      if (status.ok() && breaks != nullptr && l + 1 < layers) {
        status = LayerBoundary(l, batches[m].rows, *breaks);
      }
      if (status.ok() && l + 1 < layers) status = LayerHead(segments, batches[m], l + 1);
    }
  }
  if (!status.ok()) {   // no attend outlives the pass
    for (size_t i = 0; i < segments.size(); ++i) {
      if (started_[i]) segments[i].seq->offload->CancelAttend(tiers_, attends_[i]);
      started_[i] = 0;
    }
  }
  return status;
}

absl::Status ModelRunner::ProjectRotated(const DeviceLayer& w, const MicroBatch& mb,
                                         const float* x, float* xn, float* y, int64_t cols) {
  const ModelConfig& c = model_.config();
  const int64_t H = c.hidden_size, D = c.head_dim, Hq = c.num_q_heads, Hkv = c.num_kv_heads;
  const int64_t n = mb.rows;
  const bool with_k = cols > Hq * D;   // [q | k | v] rows, else the q rows alone
  TANDEM_RETURN_IF_ERROR(backend_.RmsNorm(
      {x, w.attn_norm.data(), w.attn_norm.dtype, xn, n, H, static_cast<float>(c.rms_norm_eps)}));
  MatMulParams mm;
  mm.x = xn;
  mm.w = w.qkv.data();   // [q Hq·D | k | v] rows: the first `cols` of them
  mm.w_dtype = w.qkv.dtype;
  mm.w_scale = w.qkv.scale_data();
  mm.bias = w.qkv_bias.buffer ? w.qkv_bias.buffer.as<float>() : nullptr;
  mm.y = y;
  mm.m = n;
  mm.n = cols;
  mm.k = H;
  TANDEM_RETURN_IF_ERROR(backend_.MatMul(mm));
  // Qwen3: every q and k head normed before RoPE (nothing for models without the norms).
  const double eps = c.rms_norm_eps;
  TANDEM_RETURN_IF_ERROR(NormHeads(backend_, w.q_norm, y, n, Hq, D, cols, eps));
  if (with_k) TANDEM_RETURN_IF_ERROR(NormHeads(backend_, w.k_norm, y + Hq * D, n, Hkv, D, cols, eps));
  RopeParams rope;
  rope.row_stride = cols;
  rope.positions = act_.positions.as<int32_t>() + mb.row0;
  rope.inv_freq = model_.inv_freq();
  rope.attention_scaling = model_.rope_attention_scaling();
  if (rope_per_row_) {
    rope.inv_freq_row_stride = D / 2;
    rope.inv_freq = act_.rope_inv_freq.as<float>() + mb.row0 * (D / 2);
  }
  rope.num_tokens = n;
  rope.head_dim = D;
  // q and k heads are adjacent in a qkv row ([q Hq·D][k Hkv·D][v Hkv·D]): one call rotates both.
  rope.x = y;
  rope.num_heads = with_k ? Hq + Hkv : Hq;
  return backend_.Rope(rope);
}

absl::Status ModelRunner::LayerHead(std::vector<Segment>& segments, const MicroBatch& mb,
                                    int64_t layer) {
  const ModelConfig& c = model_.config();
  const int64_t H = c.hidden_size, D = c.head_dim, Hq = c.num_q_heads, Hkv = c.num_kv_heads;
  const int64_t QKV = (Hq + 2 * Hkv) * D;
  float* x = act_.x.as<float>() + mb.row0 * H;
  float* xn = act_.xn.as<float>() + mb.row0 * H;
  float* qkv = act_.qkv.as<float>() + mb.row0 * QKV;
  TANDEM_RETURN_IF_ERROR(ProjectRotated(model_.layer(layer), mb, x, xn, qkv, QKV));
  const size_t end = mb.first + mb.count;
  write_kv_.clear();
  for (size_t i = mb.first; i < end; ++i) {
    const Segment& s = segments[i];
    const float* rows = act_.qkv.as<float>() + s.row0 * QKV;
    WriteKvParams wk;
    wk.k = rows + Hq * D;
    wk.v = rows + (Hq + Hkv) * D;
    wk.row_stride = QKV;
    wk.slots = act_.slots.as<int32_t>() + s.row0;
    wk.k_cache = s.seq->window.k(layer);
    wk.v_cache = s.seq->window.v(layer);
    wk.cache_dtype = s.seq->window.geometry().dtype;
    wk.num_tokens = s.n;
    wk.num_kv_heads = Hkv;
    wk.capacity = s.seq->window.capacity();
    wk.head_dim = D;
    write_kv_.push_back(wk);
  }
  TANDEM_RETURN_IF_ERROR(backend_.WriteKvBatch(write_kv_.data(), write_kv_.size()));
  // Tiers that keep layer inputs instead of K/V (offload_tier.h) take this layer's x̂ rows.
  for (size_t i = mb.first; i < end; ++i) {
    const Segment& s = segments[i];
    OffloadTier* tier = s.seq->offload.get();
    if (tier == nullptr || !tier->wants_layer_inputs()) continue;
    TANDEM_RETURN_IF_ERROR(tier->TakeLayerInputs(tiers_, layer, act_.xn.as<float>() + s.row0 * H,
                                                 s.n, positions_host_[s.row0]));
  }
  // The tiers start first (q goes to the CPU nodes) so that they work while the device
  // attends over the windows. Their downloads (q, chosen pages) run together: the host waits
  // for the device once per micro-batch and layer.
  tiers_.ClearQueues();
  bool any = false;
  for (size_t i = mb.first; i < end; ++i) {
    if (!segments[i].attends) continue;
    attends_[i] = AttendRowsOf(segments[i], i, layer);
    TANDEM_RETURN_IF_ERROR(segments[i].seq->offload->PrepareAttend(tiers_, attends_[i]));
    any = true;
  }
  if (any) {
    TANDEM_RETURN_IF_ERROR(layer_clock_->HeadQueued());
    const Clock::time_point t0 = Clock::now();
    TANDEM_RETURN_IF_ERROR(tiers_.FlushDownloads());
    tiers_.profile().q_download_s += Seconds(t0);
    TANDEM_RETURN_IF_ERROR(layer_clock_->Collect(profile_));
  }
  for (size_t i = mb.first; i < end; ++i) {
    if (!segments[i].attends) continue;
    TANDEM_RETURN_IF_ERROR(segments[i].seq->offload->StartAttend(tiers_, attends_[i]));
    started_[i] = 1;
  }
  if (any) TANDEM_RETURN_IF_ERROR(layer_clock_->Sent());
  // Every segment's window attention in one call (one launch for the decoding ones on cuda),
  // after every tier has started, as before: the windows' outputs are read only in LayerTail.
  window_attention_.clear();
  for (size_t i = mb.first; i < end; ++i) {
    window_attention_.push_back(segments[i].attends ? attends_[i].window
                                                    : WindowParams(segments[i], layer));
    if (ObservesMaw(segments[i])) {
      window_attention_.push_back(ObservationParams(segments[i], layer));
    }
  }
  TANDEM_RETURN_IF_ERROR(
      backend_.WindowAttentionBatch(window_attention_.data(), window_attention_.size()));
  // Queued after the window attention, which the tail reads first: on the device the guess and
  // the next layer's selection then run while the host waits for this layer's CPU nodes.
  TANDEM_RETURN_IF_ERROR(SpeculateNextLayer(segments, mb, layer));
  return layer_clock_->Speculated();
}

absl::Status ModelRunner::SpeculateNextLayer(std::vector<Segment>& segments,
                                             const MicroBatch& mb, int64_t layer) {
  const ModelConfig& c = model_.config();
  if (!options_.speculate_pages || layer + 1 >= c.num_layers) return absl::OkStatus();
  const size_t end = mb.first + mb.count;
  bool any = false;
  for (size_t i = mb.first; i < end; ++i) {
    any |= segments[i].attends && segments[i].seq->offload->speculates();
  }
  if (!any) return absl::OkStatus();
  // q̂ of layer l+1 from layer l's input x_l (the tail has not added layer l's attention and FFN
  // yet): LayerHead's norm, projection (the q rows of W_qkv, its first H_q·D rows), q norm and
  // RoPE, on the micro-batch's rows.
  const int64_t H = c.hidden_size, Q = c.num_q_heads * c.head_dim;
  TANDEM_RETURN_IF_ERROR(ProjectRotated(model_.layer(layer + 1), mb,
                                        act_.x.as<float>() + mb.row0 * H,
                                        act_.xn_guess.as<float>() + mb.row0 * H,
                                        act_.q_guess.as<float>() + mb.row0 * Q, Q));
  for (size_t i = mb.first; i < end; ++i) {
    const Segment& s = segments[i];
    if (!s.attends || !s.seq->offload->speculates()) continue;
    AttendRows next = AttendRowsOf(s, i, layer + 1);
    next.window.q = act_.q_guess.as<float>() + s.row0 * Q;
    next.window.q_row_stride = Q;
    TANDEM_RETURN_IF_ERROR(s.seq->offload->Speculate(tiers_, next));
  }
  // The selections the tiers queued run now, not with the next layer's downloads.
  return tiers_.FlushSelects();
}

absl::Status ModelRunner::LayerTail(std::vector<Segment>& segments, const MicroBatch& mb,
                                    int64_t layer) {
  const ModelConfig& c = model_.config();
  const int64_t H = c.hidden_size, D = c.head_dim, Hq = c.num_q_heads;
  const int64_t I = c.intermediate_size;
  const int64_t n = mb.rows;
  // Every started attend is finished (or, after an error, cancelled) before returning; the
  // partial states the tiers queued are uploaded and merged together.
  tiers_.ClearQueues();
  absl::Status status;
  for (size_t i = mb.first; i < mb.first + mb.count; ++i) {
    if (!started_[i]) continue;
    started_[i] = 0;
    OffloadTier& tier = *segments[i].seq->offload;
    if (!status.ok()) {
      tier.CancelAttend(tiers_, attends_[i]);
      continue;
    }
    absl::StatusOr<bool> degraded = tier.FinishAttend(tiers_, attends_[i]);
    if (!degraded.ok()) {
      status = degraded.status();
    } else if (*degraded) {
      ++segments[i].seq->degraded_steps;
    }
  }
  TANDEM_RETURN_IF_ERROR(status);
  TANDEM_RETURN_IF_ERROR(layer_clock_->Answered());
  const Clock::time_point t0 = Clock::now();
  TANDEM_RETURN_IF_ERROR(tiers_.FlushMerges());
  tiers_.profile().merge_upload_s += Seconds(t0);

  float* x = act_.x.as<float>() + mb.row0 * H;
  float* xn = act_.xn.as<float>() + mb.row0 * H;
  float* gate_up = act_.gate_up.as<float>() + mb.row0 * 2 * I;
  float* ffn = act_.ffn.as<float>() + mb.row0 * I;
  const DeviceLayer& w = model_.layer(layer);
  MatMulParams mm;
  mm.x = act_.attn.as<float>() + mb.row0 * Hq * D;
  mm.w = w.o_proj.data();
  mm.w_dtype = w.o_proj.dtype;
  mm.w_scale = w.o_proj.scale_data();
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
  mm.w_scale = w.gate_up.scale_data();
  mm.y = gate_up;
  mm.m = n;
  mm.n = 2 * I;
  mm.k = H;
  TANDEM_RETURN_IF_ERROR(backend_.MatMul(mm));
  TANDEM_RETURN_IF_ERROR(backend_.SwiGlu({gate_up, ffn, n, I}));
  mm = {};
  mm.x = ffn;
  mm.w = w.down_proj.data();
  mm.w_dtype = w.down_proj.dtype;
  mm.w_scale = w.down_proj.scale_data();
  mm.y = x;
  mm.m = n;
  mm.n = H;
  mm.k = I;
  mm.accumulate = true;
  return backend_.MatMul(mm);
}

absl::Status ModelRunner::Logits(const std::vector<Segment>& segments, int64_t n,
                                 const int32_t* targets, float* logprobs) {
  const ModelConfig& c = model_.config();
  const int64_t H = c.hidden_size, V = c.vocab_size;
  const float* x = act_.x.as<float>();
  float* xn = act_.xn.as<float>();
  // Logits: every row when log-probs are wanted (one segment); else the last row of each
  // segment by entry, gathered into contiguous rows unless they already are (one segment, or
  // decode rows in entry order).
  bool in_entry_order = true;
  for (size_t i = 0; i < segments.size(); ++i) in_entry_order &= segments[i].entry == i;
  const int64_t count = static_cast<int64_t>(segments.size());
  const bool contiguous = count == 1 || (n == count && in_entry_order);
  const int64_t rows = targets != nullptr ? n : (contiguous ? (count == 1 ? 1 : n) : count);
  if (rows > logits_rows_) {
    TANDEM_RETURN_IF_ERROR(AllocFloats(backend_, logits_, options_.max_chunk * V));
    logits_rows_ = options_.max_chunk;
  }
  const float* head_in = x + (n - rows) * H;
  if (targets == nullptr && !contiguous) {
    if (last_rows_.bytes() == 0) {
      TANDEM_RETURN_IF_ERROR(AllocFloats(backend_, last_rows_, options_.max_chunk * H));
    }
    for (const Segment& s : segments) {
      TANDEM_RETURN_IF_ERROR(backend_.CopyOnDevice(last_rows_.as<float>() + s.entry * H,
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
  if (targets == nullptr) return absl::OkStatus();
  std::vector<int32_t> safe(targets, targets + n);
  for (int32_t& t : safe) t = (t >= 0 && t < V) ? t : 0;
  TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(act_.targets.data(), safe.data(), n * 4));
  TANDEM_RETURN_IF_ERROR(backend_.TokenLogProbs(
      {logits_.as<float>(), act_.targets.as<int32_t>(), act_.logprobs.as<float>(), n, V}));
  TANDEM_RETURN_IF_ERROR(backend_.CopyToHost(logprobs, act_.logprobs.data(), n * 4));
  for (int64_t i = 0; i < n; ++i) {
    if (targets[i] < 0 || targets[i] >= V) logprobs[i] = 0.0f;
  }
  return absl::OkStatus();
}

WindowAttentionParams ModelRunner::WindowParams(const Segment& s, int64_t layer) const {
  const ModelConfig& c = model_.config();
  const int64_t D = c.head_dim, Hq = c.num_q_heads, Hkv = c.num_kv_heads;
  const int64_t QKV = (Hq + 2 * Hkv) * D;
  WindowAttentionParams wa;
  wa.q = act_.qkv.as<float>() + s.row0 * QKV;
  wa.q_row_stride = QKV;
  wa.q_pos = act_.positions.as<int32_t>() + s.row0;
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
  wa.o = act_.attn.as<float>() + s.row0 * Hq * D;
  wa.lse = act_.lse.as<float>() + s.row0 * Hq;
  if (s.seq->offload != nullptr && s.seq->offload->wants_maw() && !s.seq->window.widened()) {
    wa.maw = s.seq->window.maw(layer);
    wa.alpha = options_.maw_alpha;
  }
  return wa;
}

AttendRows ModelRunner::AttendRowsOf(const Segment& s, size_t index, int64_t layer) {
  const int64_t D = model_.config().head_dim, Hq = model_.config().num_q_heads;
  AttendRows a;
  a.layer = layer;
  a.window = WindowParams(s, layer);
  a.q_host = act_.q_host.data() + s.row0 * Hq * D;
  a.o_host = act_.o_host.data() + s.row0 * Hq * D;
  a.lse_host = act_.lse_host.data() + s.row0 * Hq;
  a.part_o = act_.part_o.as<float>() + s.row0 * Hq * D;
  a.part_lse = act_.part_lse.as<float>() + s.row0 * Hq;
  a.policy.reselect = s.seq->reselect_pending;
  a.policy.reselect_beta = s.seq->reselect_beta;
  a.policy.captured_mass = &s.seq->captured_mass;
  a.stream = index;
  return a;
}

bool ModelRunner::ObservesMaw(const Segment& s) {
  const Sequence& seq = *s.seq;
  const WindowCache& w = seq.window;
  // NOTE: the MAW update weighs every window slot for every query row, on CUDA cores: over a
  // widened window in every pass it would add O(prompt²) to the prefill's tensor-core
  // attention (an estimated 1-2 s at 32K on an H100, not measured). So a widened prefill leaves MAW to its last pass and
  // to passes after which blocks leave (a prompt larger than the widened window), and there to
  // the pass's last kMawObservationRows rows. Called after the pass's Append.
  return seq.offload != nullptr && seq.offload->wants_maw() && w.widened() &&
         (w.next_position() >= seq.prefill_end || w.recent_tokens() > w.options().window);
}

WindowAttentionParams ModelRunner::ObservationParams(const Segment& s, int64_t layer) const {
  const ModelConfig& c = model_.config();
  const int64_t D = c.head_dim, Hq = c.num_q_heads, QKV = (Hq + 2 * c.num_kv_heads) * D;
  const int64_t rows = std::min(kMawObservationRows, s.n), skip = s.n - rows;
  WindowAttentionParams wa = WindowParams(s, layer);
  wa.q += skip * QKV;
  wa.q_pos += skip;
  wa.num_tokens = rows;
  // The output goes to the tier's scratch rows of the same tokens: this attention is only for
  // its MAW update (queued before any tier writes its partial state there in LayerTail).
  wa.o = act_.part_o.as<float>() + (s.row0 + skip) * Hq * D;
  wa.lse = act_.part_lse.as<float>() + (s.row0 + skip) * Hq;
  wa.maw = s.seq->window.maw(layer);
  wa.alpha = options_.maw_alpha;
  return wa;
}

absl::StatusOr<int64_t> ModelRunner::SettleSlice(Sequence& seq, int64_t max_tokens) {
  return Settle(seq, max_tokens, /*defer=*/true);
}

absl::StatusOr<int64_t> ModelRunner::Settle(Sequence& seq, int64_t max_tokens, bool defer) {
  if (!seq.window.settling()) return 0;
  // MAW of these entries: a widened prefill kept each prompt entry on the device until the
  // prompt was in and updated MAW from the prompt's last kMawObservationRows query rows only
  // (ObservesMaw), so an entry's MAW is the mean attention weight those rows gave it,
  // normalised over the whole prompt on the device rather than over a window's span: a
  // query-aware score like SnapKV's observation window. Decode steps while the settle is under
  // way update it further (the window's MAW rule: the blocks are window entries until they
  // leave). The selection threshold β / n_gpu uses the configured window (eviction_entries).
  std::vector<EvictedBlock> blocks = seq.window.PendingEvictions();
  // A tier that would rather the append stopped short (its page index calibrating) gets a
  // slice that ends there, or none this step; the budget left goes to other sessions.
  if (defer && seq.offload != nullptr) {
    TANDEM_ASSIGN_OR_RETURN(const int64_t limit, seq.offload->AppendLimit());
    if (limit <= 0) return 0;
    max_tokens = std::min(max_tokens, limit);
  }
  int64_t tokens = 0;
  size_t take = 0;
  while (take < blocks.size() && (take == 0 || tokens + blocks[take].count <= max_tokens)) {
    tokens += blocks[take++].count;
  }
  blocks.resize(take);
  const absl::Status status = EvictBlocks(seq, blocks);
  static_cast<OffloadProfile&>(profile_) = tiers_.profile();   // (its evict_* parts)
  TANDEM_RETURN_IF_ERROR(status);
  return tokens;
}

absl::Status ModelRunner::SettleEvictions(Sequence& seq) {
  return Settle(seq, std::numeric_limits<int64_t>::max(), /*defer=*/false).status();
}

absl::Status ModelRunner::Evict(Sequence& seq) {
  return EvictBlocks(seq, seq.window.PendingEvictions());
}

absl::Status ModelRunner::EvictBlocks(Sequence& seq, const std::vector<EvictedBlock>& blocks) {
  if (blocks.empty()) return absl::OkStatus();
  if (seq.offload == nullptr) {
    return absl::FailedPreconditionError("window eviction without an offload tier");
  }
  // In groups of at most TierContext::kEvictGroupTokens (a settle after a widened prefill moves
  // a whole prompt): the context's host staging stays that size, whatever the prompt.
  std::vector<EvictedBlock> group;
  int64_t group_tokens = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    group.push_back(blocks[i]);
    group_tokens += blocks[i].count;
    const bool last = i + 1 == blocks.size();
    if (!last && group_tokens + blocks[i + 1].count <= TierContext::kEvictGroupTokens) continue;
    TANDEM_RETURN_IF_ERROR(seq.offload->Append(tiers_, seq.window, group));
    TANDEM_RETURN_IF_ERROR(seq.window.Release(group));
    group.clear();
    group_tokens = 0;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> ModelRunner::LastLogitsToHost() {
  if (last_logits_ == nullptr) return absl::FailedPreconditionError("no forward pass yet");
  std::vector<float> logits(model_.config().vocab_size);
  TANDEM_RETURN_IF_ERROR(backend_.CopyToHost(logits.data(), last_logits_, logits.size() * 4));
  return logits;
}

}  // namespace tandem::gpu_worker
