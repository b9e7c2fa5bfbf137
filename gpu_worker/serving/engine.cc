#include "tandem/gpu_worker/engine.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "spdlog/spdlog.h"
#include "tandem/gpu_worker/host_tier.h"
#include "tandem/gpu_worker/node_tier.h"
#include "tandem/gpu_worker/request_validation.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

// Positions a gpu-mode window is sized for: what the request plans to reach, rounded up to
// 256 so that a later turn often fits without Grow, within the engine's context.
int64_t GpuWindowPositions(int64_t planned, int64_t max_context) {
  constexpr int64_t kGranule = 256;
  return std::min(max_context, (planned + kGranule - 1) / kGranule * kGranule);
}

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const EngineOptions& options) {
  if (options.backend == "cpu") return CreateCpuBackend(options.cpu_threads);
  if (options.backend == "cuda") return CreateCudaBackend(options.cuda_device);
  if (options.backend != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown backend '", options.backend, "'; expected auto, cpu or cuda"));
  }
  if (CudaBackendCompiled()) {
    auto cuda = CreateCudaBackend(options.cuda_device);
    if (cuda.ok()) return cuda;
    spdlog::info("cuda backend unavailable ({}); using the cpu backend", cuda.status().ToString());
  }
  return CreateCpuBackend(options.cpu_threads);
}

}  // namespace

std::string_view FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kContext:
      return "context";
    case FinishReason::kCancelled:
      return "cancelled";
  }
  return "?";
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  auto engine = std::unique_ptr<Engine>(new Engine());
  engine->options_ = options;
  if (options.prefill_chunk < 1 || options.prefill_chunk > 65536) {
    return absl::InvalidArgumentError("prefill_chunk must be in 1..65536");
  }
  if (options.block_tokens < 1 || options.block_tokens > 4096) {
    return absl::InvalidArgumentError("block_tokens must be in 1..4096");
  }
  if (options.max_sessions < 1) return absl::InvalidArgumentError("max_sessions must be >= 1");
  if (options.page_tokens < 1 || options.page_tokens > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_tokens must be in 1..4096, got ", options.page_tokens));
  }
  if (options.default_selection == SelectionRule::kPages) {
    TANDEM_RETURN_IF_ERROR(engine->CheckPagesUsable());
  }
  TANDEM_RETURN_IF_ERROR(engine->ValidatePagePolicy(options.default_page_policy));
  if (options.random_weights) {
    // The geometry of config.json, weights made on the device: no weights file is read.
    engine->model_ = std::make_unique<Model>();
    engine->model_->dir = options.model_dir;
    TANDEM_ASSIGN_OR_RETURN(engine->model_->config, LoadModelConfig(options.model_dir));
    engine->model_->weights.dtype = engine->model_->config.weight_dtype;
  } else {
    TANDEM_ASSIGN_OR_RETURN(engine->model_, LoadModel(options.model_dir));
  }
  TANDEM_ASSIGN_OR_RETURN(engine->tokenizer_, LoadTokenizer(options.model_dir));
  const ModelConfig& c = engine->model_->config;
  if (engine->tokenizer_->vocab_size() > c.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("the tokenizer has ", engine->tokenizer_->vocab_size(),
                     " tokens but the model's vocabulary is ", c.vocab_size));
  }
  engine->max_context_ = c.max_position_embeddings;
  if (options.max_context > 0) engine->max_context_ = std::min(engine->max_context_, options.max_context);
  if (options.kv_dtype == "auto") {
    engine->kv_dtype_ = engine->model_->weights.dtype == DType::kF32 ? DType::kF32 : DType::kBF16;
  } else if (options.kv_dtype == "bf16") {
    engine->kv_dtype_ = DType::kBF16;
  } else if (options.kv_dtype == "f32") {
    engine->kv_dtype_ = DType::kF32;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_dtype must be auto, bf16 or f32, got '", options.kv_dtype, "'"));
  }
  TANDEM_ASSIGN_OR_RETURN(engine->backend_, MakeBackend(options));
  if (options.random_weights) {
    TANDEM_ASSIGN_OR_RETURN(engine->device_model_,
                            DeviceModel::CreateRandom(c, *engine->backend_, options.random_seed));
  } else {
    TANDEM_ASSIGN_OR_RETURN(engine->device_model_,
                            DeviceModel::Upload(*engine->model_, *engine->backend_));
  }
  RunnerOptions runner_options;
  runner_options.max_chunk = options.prefill_chunk;
  runner_options.maw_alpha = options.maw_alpha;
  runner_options.measure_captured_mass = options.measure_captured_mass;
  TANDEM_ASSIGN_OR_RETURN(engine->runner_, ModelRunner::Create(*engine->backend_,
                                                               *engine->device_model_,
                                                               runner_options));
  TANDEM_ASSIGN_OR_RETURN(engine->nodes_, NodePool::Create(options.nodes));
  // Session ids on CPU nodes are shared by every worker using them: prefix ours uniquely.
  std::random_device rd;
  engine->id_prefix_ = absl::StrFormat("w%d-%08x", static_cast<int>(getpid()), rd());
  return engine;
}

Engine::~Engine() {
  // Close sessions while the node pool (and an embedded node) still exist.
  sessions_.clear();
}

absl::Status Engine::ValidateIds(const std::vector<int32_t>& ids) const {
  const int64_t vocab = model_->config.vocab_size;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", ids[i], " at prompt position ",
                                                     i, " is outside the vocabulary [0, ",
                                                     vocab, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::CheckPagesUsable() const {
  if (options_.block_tokens % options_.page_tokens != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "selection=pages needs page_tokens (", options_.page_tokens,
        ") to divide the worker's block_tokens (", options_.block_tokens, ")"));
  }
  return absl::OkStatus();
}

absl::Status Engine::ValidatePagePolicy(const PagePolicy& policy) const {
  if (policy.select_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("select_tokens must be >= 1, got ", policy.select_tokens));
  }
  if (policy.dense_layers < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dense_layers must be >= 0, got ", policy.dense_layers));
  }
  return absl::OkStatus();
}

size_t Engine::PageSummaryBytes() const {
  size_t bytes = 0;
  for (const auto& [id, seq] : sessions_) bytes += seq->pages ? seq->pages->device_bytes() : 0;
  return bytes;
}

absl::Status Engine::ReservePages(Sequence& seq, int64_t expected_offloaded) const {
  if (seq.pages == nullptr) return absl::OkStatus();
  const int64_t page = options_.page_tokens;
  const int64_t pages = (expected_offloaded + page - 1) / page;
  if (pages <= seq.pages->capacity_pages()) return absl::OkStatus();
  const size_t need = PageIndex::BytesFor(seq.pages->geometry(), page, expected_offloaded);
  const size_t others = PageSummaryBytes() - seq.pages->device_bytes();
  if (options_.page_summary_bytes > 0 && others + need > options_.page_summary_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "page summaries for ", expected_offloaded, " offloaded tokens need ", need,
        " bytes of device memory (", page, "-token pages), and ", others, " of the worker's ",
        options_.page_summary_bytes,
        " page-summary bytes are in use: ask for fewer tokens, wait for other sessions to end, "
        "use selection=maw, or start the worker with larger --page_tokens or "
        "--page_summary_bytes"));
  }
  return seq.pages->Reserve(pages);
}

WindowGeometry Engine::window_geometry() const {
  const ModelConfig& c = model_->config;
  return {c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype_};
}

WindowOptions Engine::WindowOptionsFor(const SequenceSpec& spec, int64_t planned_positions) const {
  WindowOptions wo;
  wo.block = options_.block_tokens;
  wo.max_chunk = options_.prefill_chunk;
  wo.max_context = max_context_;
  if (spec.mode == AttentionMode::kGpu) {
    wo.window = WindowOptions::kUnlimited;
    wo.sink = 0;
    wo.max_context = GpuWindowPositions(planned_positions, max_context_);
  } else {
    wo.window = spec.window;
    wo.sink = spec.sink;
  }
  return wo;
}

size_t Engine::DeviceKvBytes() const {
  size_t bytes = 0;
  for (const auto& [id, seq] : sessions_) {
    bytes += seq->window.device_bytes() + (seq->pages ? seq->pages->device_bytes() : 0);
  }
  return bytes;
}

absl::Status Engine::CheckDeviceKv(size_t more) const {
  if (options_.kv_cache_bytes == 0 || more == 0) return absl::OkStatus();
  const size_t used = DeviceKvBytes();
  if (used + more <= options_.kv_cache_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the request needs ", more, " more bytes of device KV (window and page summaries for its "
      "prompt + max_tokens) and ", used, " of the worker's ", options_.kv_cache_bytes,
      " are in use: ask for fewer tokens, use a smaller window or hybrid mode, wait for other "
      "sessions to end, or start the worker with a larger --kv_cache_bytes"));
}

absl::StatusOr<std::unique_ptr<Sequence>> Engine::NewSequence(const std::string& id,
                                                              const SequenceSpec& spec,
                                                              int64_t planned_positions,
                                                              int64_t expected_offloaded) {
  const AttentionMode mode = spec.mode;
  const float beta = spec.beta;
  const ModelConfig& c = model_->config;
  const WindowGeometry geometry = window_geometry();
  const WindowOptions wo = WindowOptionsFor(spec, planned_positions);
  TANDEM_ASSIGN_OR_RETURN(WindowCache cache, WindowCache::Create(*backend_, geometry, wo));
  auto seq = std::make_unique<Sequence>(id, mode, std::move(cache));
  // The page summaries belong to the node tier made below; seq->pages views them.
  std::unique_ptr<PageIndex> pages;
  if (mode == AttentionMode::kHybrid && spec.selection == SelectionRule::kPages) {
    seq->selection = SelectionRule::kPages;
    seq->page_policy = spec.page_policy;
    TANDEM_ASSIGN_OR_RETURN(PageIndex index,
                            PageIndex::Create(*backend_, geometry, options_.page_tokens, 0));
    pages = std::make_unique<PageIndex>(std::move(index));
    seq->pages = pages.get();
    TANDEM_RETURN_IF_ERROR(ReservePages(*seq, expected_offloaded));
  }
  if (mode == AttentionMode::kHybrid) {
    RemoteKvOptions ro;
    ro.session_id = absl::StrCat(id_prefix_, ".", id);
    ro.num_layers = c.num_layers;
    ro.num_q_heads = c.num_q_heads;
    ro.num_kv_heads = c.num_kv_heads;
    ro.head_dim = c.head_dim;
    ro.kv_dtype = kv_dtype_;
    ro.beta = beta;
    ro.block_tokens = options_.block_tokens >= 16 && options_.block_tokens <= 256
                          ? static_cast<uint32_t>(options_.block_tokens)
                          : 0;
    ro.attend_deadline_ms = options_.attend_deadline_ms;
    ro.expected_tokens = expected_offloaded;
    ro.placement = options_.placement;
    ro.replan_every_steps = options_.replan_every_steps;
    ro.replan_min_gain = options_.replan_min_gain;
    ro.selection = seq->selection;
    ro.page_tokens = static_cast<uint32_t>(options_.page_tokens);
    TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<RemoteKv> remote, RemoteKv::Open(*nodes_, ro));
    seq->offload = std::make_unique<NodeTier>(std::move(remote), std::move(pages));
  }
  if (mode == AttentionMode::kOffload) {
    TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<OffloadedKv> kv,
                            OffloadedKv::Create(*backend_, geometry, options_.offload_page_tokens));
    seq->offload = std::make_unique<HostTier>(std::move(kv));
  }
  return seq;
}

absl::StatusOr<GenerateSummary> Engine::Generate(const GenerateRequest& request,
                                                 const GenerateCallbacks& callbacks) {
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Generation> g,
                          Begin(request, callbacks, Generation::Clock::now()));
  while (!g->finished() && !g->CancelledBy(Generation::Clock::now())) {
    // A failed step records its failure in g; End reports it.
    (void)Step({{g.get(), std::min(g->remaining(), max_step_tokens())}});
  }
  return End(*g);
}

bool Generation::CancelledBy(Clock::time_point now) const {
  if (request.deadline.has_value() && now >= *request.deadline) return true;
  return callbacks.cancelled && callbacks.cancelled();
}

absl::StatusOr<std::unique_ptr<Generation>> Engine::Begin(GenerateRequest request,
                                                          GenerateCallbacks callbacks,
                                                          Generation::Clock::time_point arrival) {
  // --- Validation: everything is checked before any state changes.
  TANDEM_RETURN_IF_ERROR(ValidateGenerateRequest(request, 0));
  PagePolicy page_policy = options_.default_page_policy;
  if (request.select_tokens.has_value()) page_policy.select_tokens = *request.select_tokens;
  if (request.dense_layers.has_value()) page_policy.dense_layers = *request.dense_layers;
  TANDEM_RETURN_IF_ERROR(ValidatePagePolicy(page_policy));
  // A request that sets beta but no selection asks for MAW (beta means nothing to pages).
  const SelectionRule selection = request.selection.value_or(
      request.beta.has_value() ? SelectionRule::kMaw : options_.default_selection);
  if (selection == SelectionRule::kPages) TANDEM_RETURN_IF_ERROR(CheckPagesUsable());
  const AttentionMode mode = request.mode.value_or(options_.default_mode);
  const float beta = request.beta.value_or(options_.default_beta);
  const int64_t window = request.window.value_or(options_.default_window);
  const int64_t sink = request.sink.value_or(options_.default_sink);
  if (window < options_.block_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("window must be >= the block size (",
                                                   options_.block_tokens, " tokens), got ",
                                                   window));
  }
  if (sink > max_context_) {
    return absl::InvalidArgumentError(absl::StrCat("sink must be in 0..", max_context_));
  }
  if (!request.session_id.empty() && SessionBusy(request.session_id)) {
    return absl::FailedPreconditionError(
        absl::StrCat("session '", request.session_id, "' is in use by another request"));
  }

  auto existing = request.session_id.empty() ? sessions_.end() : sessions_.find(request.session_id);
  const bool continuing = existing != sessions_.end();
  if (continuing) {
    const Sequence& s = *existing->second;
    if (request.mode.has_value() && *request.mode != s.mode) {
      return absl::InvalidArgumentError("a continued session keeps its attention mode");
    }
    if (s.mode == AttentionMode::kHybrid &&
        ((request.window.has_value() && *request.window != s.window.options().window) ||
         (request.sink.has_value() && *request.sink != s.window.options().sink))) {
      return absl::InvalidArgumentError("a continued session keeps its window and sink");
    }
    if (s.mode == AttentionMode::kHybrid && request.selection.has_value() &&
        *request.selection != s.selection) {
      return absl::InvalidArgumentError("a continued session keeps its selection");
    }
  }
  std::vector<int32_t> prompt = request.prompt_ids;
  if (prompt.empty()) {
    TANDEM_ASSIGN_OR_RETURN(prompt, tokenizer_->Encode(request.prompt_text, !continuing));
    if (prompt.empty()) return absl::InvalidArgumentError("the prompt has no tokens");
  }
  TANDEM_RETURN_IF_ERROR(ValidateIds(prompt));
  const int64_t already = continuing ? static_cast<int64_t>(existing->second->tokens.size()) +
                                           (existing->second->pending_token ? 1 : 0)
                                     : 0;
  if (already + static_cast<int64_t>(prompt.size()) >= max_context_) {
    return absl::InvalidArgumentError(
        absl::StrCat("the prompt (", prompt.size(), " tokens", continuing ? " after " : "",
                     continuing ? absl::StrCat(already, " in the session") : "",
                     ") leaves no room in the model's context of ", max_context_, " tokens"));
  }
  if (!continuing && sessions_.size() >= options_.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("all ", options_.max_sessions, " sessions are in use"));
  }

  // --- The session, with the memory it needs by the end of this request reserved: device
  // window (gpu mode), page summaries and CPU-node room are checked before anything runs.
  std::string id = request.session_id;
  if (id.empty()) id = absl::StrCat("anon-", next_anonymous_id_++);
  const int64_t planned = std::min<int64_t>(
      max_context_, already + static_cast<int64_t>(prompt.size()) + request.max_tokens);
  auto offloaded_by_end = [&](int64_t w, int64_t k) { return std::max<int64_t>(0, planned - w - k); };
  Sequence* seq = nullptr;
  if (continuing) {
    seq = existing->second.get();
    if (seq->mode == AttentionMode::kGpu) {
      WindowOptions grown = seq->window.options();
      grown.max_context = std::max(grown.max_context, GpuWindowPositions(planned, max_context_));
      const size_t bytes = WindowCache::BytesFor(seq->window.geometry(), grown);
      TANDEM_RETURN_IF_ERROR(CheckDeviceKv(bytes > seq->window.device_bytes()
                                               ? bytes - seq->window.device_bytes()
                                               : 0));
      TANDEM_RETURN_IF_ERROR(seq->window.Grow(grown.max_context));
    }
    if (seq->selection == SelectionRule::kPages) {
      if (request.select_tokens.has_value() || request.dense_layers.has_value()) {
        seq->page_policy = page_policy;
      }
      TANDEM_RETURN_IF_ERROR(ReservePages(*seq, offloaded_by_end(seq->window.options().window,
                                                                 seq->window.options().sink)));
    }
    TANDEM_RETURN_IF_ERROR(seq->ReserveOffloaded(
        offloaded_by_end(seq->window.options().window, seq->window.options().sink)));
  } else {
    const SequenceSpec spec{mode, beta, window, sink, selection, page_policy};
    size_t need = WindowCache::BytesFor(window_geometry(), WindowOptionsFor(spec, planned));
    if (mode == AttentionMode::kHybrid && selection == SelectionRule::kPages) {
      need += PageIndex::BytesFor(window_geometry(), options_.page_tokens,
                                  offloaded_by_end(window, sink));
    }
    TANDEM_RETURN_IF_ERROR(CheckDeviceKv(need));
    TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> fresh,
                            NewSequence(id, spec,
                                        planned, offloaded_by_end(window, sink)));
    seq = fresh.get();
    sessions_[id] = std::move(fresh);
  }

  const uint64_t seed =
      request.sampling.seed.has_value() ? *request.sampling.seed : std::random_device{}();
  const bool keep = !request.session_id.empty();
  auto g = std::make_unique<Generation>(std::move(request), std::move(callbacks), arrival,
                                        *tokenizer_);
  g->seq = seq;
  g->session_id = id;
  g->keep_session = keep;
  g->prompt_tokens = static_cast<int64_t>(prompt.size());
  if (seq->pending_token.has_value()) g->feed.push_back(*seq->pending_token);
  g->feed.insert(g->feed.end(), prompt.begin(), prompt.end());
  seq->pending_token.reset();
  if (continuing && seq->mode == AttentionMode::kHybrid) {
    seq->reselect_pending = true;
    seq->reselect_beta = g->request.beta;
  }
  g->rng.seed(seed);
  g->degraded_before = seq->degraded_steps;
  g->last_token = arrival;
  busy_.insert(id);
  return g;
}

absl::Status Engine::Step(const std::vector<StepItem>& items) {
  std::vector<ModelRunner::BatchEntry> entries;
  int64_t total = 0;
  for (const StepItem& item : items) {
    Generation& g = *item.generation;
    if (g.finished() || item.tokens < 1 || item.tokens > g.remaining()) {
      return absl::InvalidArgumentError(absl::StrCat("step item of ", item.tokens,
                                                     " tokens for a generation with ",
                                                     g.remaining(), " to feed"));
    }
    entries.push_back({g.seq, g.feed.data() + g.fed, item.tokens});
    total += item.tokens;
  }
  if (total > max_step_tokens()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a step of ", total, " tokens; at most ", max_step_tokens()));
  }
  if (absl::Status s = runner_->Step(entries); !s.ok()) {
    for (const StepItem& item : items) item.generation->failure = s;
    return s;
  }
  const int64_t vocab = model_->config.vocab_size;
  absl::Status first_failure;
  for (size_t b = 0; b < items.size(); ++b) {
    Generation& g = *items[b].generation;
    g.fed += items[b].tokens;
    if (g.prefilling() && g.callbacks.on_prefill) {
      const double elapsed = Seconds(g.arrival, Clock::now());
      g.callbacks.on_prefill({static_cast<int64_t>(g.feed.size()), g.fed, elapsed});
    }
    if (g.remaining() > 0) continue;
    if (absl::Status s = SampleNext(g, runner_->batch_logits() + b * vocab); !s.ok()) {
      g.failure = s;
      if (first_failure.ok()) first_failure = s;
    }
  }
  return first_failure;
}

absl::Status Engine::SampleNext(Generation& g, const float* logits) {
  const SamplingOptions& sampling = g.request.sampling;
  SampleParams sp;
  sp.logits = logits;
  sp.vocab = model_->config.vocab_size;
  sp.temperature = sampling.temperature;
  sp.top_k = sampling.top_k;
  sp.top_p = sampling.top_p;
  sp.uniform = static_cast<float>(static_cast<double>(g.rng() >> 11) * 0x1.0p-53);
  if (sp.uniform >= 1.0f) sp.uniform = std::nextafter(1.0f, 0.0f);
  TANDEM_ASSIGN_OR_RETURN(const int32_t token, backend_->Sample(sp));

  const Clock::time_point now = Clock::now();
  GenerateSummary& summary = g.summary;
  const int64_t i = summary.completion_tokens;
  if (i == 0) {
    summary.time_to_first_token_s = Seconds(g.arrival, now);
  } else {
    g.latencies.push_back(Seconds(g.last_token, now));
  }
  g.last_token = now;
  g.first_token_sampled = true;
  summary.token_ids.push_back(token);
  summary.completion_tokens = i + 1;
  const std::vector<int32_t>& eos = tokenizer_->eos_ids();
  const bool is_eos = std::find(eos.begin(), eos.end(), token) != eos.end();
  TokenEvent event{token, "", i};
  std::optional<FinishReason> reason;
  if (is_eos && !g.request.ignore_eos) {
    reason = FinishReason::kEos;
  } else {
    event.text = g.stops.Push(g.decoder.Push(token));
    if (g.stops.stopped()) reason = FinishReason::kStop;
  }
  // Known before the token is reported: whether it is the last, so that its message carries
  // the text still held back (one message per token).
  if (!reason.has_value() && i + 1 == g.request.max_tokens) reason = FinishReason::kLength;
  if (!reason.has_value() && static_cast<int64_t>(g.seq->tokens.size()) + 1 >= max_context_) {
    reason = FinishReason::kContext;
  }
  if (reason.has_value() && *reason != FinishReason::kStop) {
    event.text += g.stops.Push(g.decoder.Flush());
    event.text += g.stops.Flush();
  }
  summary.text += event.text;
  const bool proceed = g.callbacks.on_token ? g.callbacks.on_token(event) : true;
  // The last sampled token is fed at the start of the session's next turn.
  g.seq->pending_token = token;
  if (!reason.has_value() && !proceed) reason = FinishReason::kCancelled;
  g.reason = reason;
  if (!reason.has_value()) {   // the next step feeds it
    g.seq->pending_token.reset();
    g.feed.assign(1, token);
    g.fed = 0;
    g.seq->MaintainOffloaded();   // between steps: migrations, placement re-plans
  }
  return absl::OkStatus();
}

absl::StatusOr<GenerateSummary> Engine::End(Generation& g) {
  busy_.erase(g.session_id);
  const Clock::time_point now = Clock::now();
  absl::Status failure = g.failure;
  if (failure.ok() && !g.reason.has_value()) {   // stopped between steps
    if (g.request.deadline.has_value() && now >= *g.request.deadline) {
      failure = absl::DeadlineExceededError(absl::StrCat(
          "the request's deadline passed after ", g.summary.completion_tokens, " tokens"));
    } else {
      g.reason = FinishReason::kCancelled;
    }
  }
  // A session whose prompt was not fed whole (stopped in prefill) or whose pass failed holds a
  // state no client asked for: it is closed even when kept.
  const bool consistent = g.failure.ok() && g.remaining() <= 1 && g.first_token_sampled;
  GenerateSummary summary = std::move(g.summary);
  summary.session_id = g.keep_session ? g.session_id : "";
  summary.prompt_tokens = g.prompt_tokens;
  summary.mode = g.seq->mode;
  summary.total_s = Seconds(g.arrival, now);
  summary.finish_reason = g.reason.value_or(FinishReason::kCancelled);
  if (!g.latencies.empty()) {
    double sum = 0.0;
    for (double l : g.latencies) sum += l;
    summary.mean_token_latency_s = sum / g.latencies.size();
    summary.p50_token_latency_s = Percentile(g.latencies, 0.5);
    summary.p99_token_latency_s = Percentile(g.latencies, 0.99);
  }
  summary.degraded_steps = g.seq->degraded_steps - g.degraded_before;
  summary.degraded = summary.degraded_steps > 0;
  summary.device_kv_entries = g.seq->device_entries();
  summary.cpu_kv_entries = g.seq->offloaded_entries();
  if (!g.keep_session || !consistent) {
    auto it = sessions_.find(g.session_id);
    if (it != sessions_.end()) {
      (void)it->second->CloseOffloaded();
      sessions_.erase(it);
    }
    g.seq = nullptr;
  } else if (g.remaining() == 1 && !g.seq->pending_token.has_value()) {
    g.seq->pending_token = g.feed[g.fed];   // sampled but not fed: the next turn feeds it
  }
  if (!failure.ok()) return failure;
  return summary;
}

absl::StatusOr<EvaluateResult> Engine::Evaluate(const EvaluateRequest& request) {
  const int64_t n = static_cast<int64_t>(request.ids.size());
  if (n < 2) return absl::InvalidArgumentError("evaluation needs at least 2 tokens");
  if (n > max_context_) {
    return absl::InvalidArgumentError(absl::StrCat("evaluation of ", n,
                                                   " tokens exceeds the context of ",
                                                   max_context_));
  }
  if (!(std::isfinite(request.beta) && request.beta >= 0.0f)) {
    return absl::InvalidArgumentError("beta must be finite and >= 0");
  }
  if (request.window < options_.block_tokens || request.sink < 0) {
    return absl::InvalidArgumentError("window must be >= the block size and sink >= 0");
  }
  TANDEM_RETURN_IF_ERROR(ValidateIds(request.ids));
  const std::string id = absl::StrCat("eval-", next_anonymous_id_++);
  TANDEM_RETURN_IF_ERROR(ValidatePagePolicy(request.page_policy));
  if (request.selection == SelectionRule::kPages) TANDEM_RETURN_IF_ERROR(CheckPagesUsable());
  TANDEM_ASSIGN_OR_RETURN(
      std::unique_ptr<Sequence> seq,
      NewSequence(id,
                  {request.mode, request.beta, request.window, request.sink, request.selection,
                   request.page_policy},
                  n, std::max<int64_t>(0, n - request.window - request.sink)));
  std::vector<int32_t> targets(request.ids.begin() + 1, request.ids.end());
  targets.push_back(-1);
  std::vector<float> logprobs(n, 0.0f);
  ForwardOptions fo;
  fo.targets = targets.data();
  fo.logprobs = logprobs.data();
  TANDEM_RETURN_IF_ERROR(runner_->Forward(*seq, request.ids.data(), n, fo));
  EvaluateResult result;
  for (int64_t i = 0; i + 1 < n; ++i) result.nll_sum -= logprobs[i];
  result.predictions = n - 1;
  result.selected_share = seq->MeanSelectedShare();
  const CapturedMass& mass = seq->captured_mass;
  for (size_t l = 0; l < mass.sum.size(); ++l) {
    result.captured_mass.push_back(mass.count[l] ? mass.sum[l] / mass.count[l] : 0.0);
  }
  result.cpu_kv_entries = seq->offloaded_entries();
  result.degraded_steps = seq->degraded_steps;
  return result;
}

absl::StatusOr<std::vector<int32_t>> Engine::Tokenize(const std::string& text,
                                                      bool add_bos) const {
  return tokenizer_->Encode(text, add_bos);
}

std::string Engine::Detokenize(const std::vector<int32_t>& ids) const {
  return tokenizer_->Decode(ids);
}

absl::Status Engine::CloseSession(const std::string& session_id) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("no session '", session_id, "'"));
  }
  absl::Status closed = it->second->CloseOffloaded();
  sessions_.erase(it);
  return closed;
}

ModelInfo Engine::info() const {
  const ModelConfig& c = model_->config;
  ModelInfo info;
  info.model_dir = options_.model_dir;
  info.model_type = c.model_type;
  info.backend = std::string(backend_->name());
  info.device = backend_->device_description();
  info.num_layers = c.num_layers;
  info.num_q_heads = c.num_q_heads;
  info.num_kv_heads = c.num_kv_heads;
  info.head_dim = c.head_dim;
  info.hidden_size = c.hidden_size;
  info.vocab_size = c.vocab_size;
  info.max_context = max_context_;
  info.weight_dtype = std::string(DTypeName(model_->weights.dtype));
  info.kv_dtype = std::string(DTypeName(kv_dtype_));
  info.weight_bytes = device_model_->weight_bytes();
  info.cpu_nodes = nodes_->size();
  info.tokenizer_kind = std::string(tokenizer_->kind());
  return info;
}

}  // namespace tandem::gpu_worker
