#include "tandem/gpu_worker/engine.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "spdlog/spdlog.h"
#include "tandem/gpu_worker/exact_tier.h"
#include "tandem/gpu_worker/host_page_streams.h"
#include "tandem/gpu_worker/host_tier.h"
#include "tandem/gpu_worker/kv_recompute.h"
#include "tandem/gpu_worker/memory_plan.h"
#include "tandem/gpu_worker/node_tier.h"
#include "tandem/gpu_worker/page_index.h"
#include "tandem/gpu_worker/prefill_spill_tier.h"
#include "tandem/gpu_worker/tier_factory.h"
#include "tandem/gpu_worker/tier_traits.h"
#include "tandem/common/byte_size.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {
namespace {

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const EngineOptions& options) {
  const BackendOptions& backend = options.backend_options;
  if (options.backend == "cpu") return CreateCpuBackend(options.cpu_threads, backend);
  if (options.backend == "cuda") return CreateCudaBackend(options.cuda_device, backend);
  if (options.backend != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown backend '", options.backend, "'; expected auto, cpu or cuda"));
  }
  if (CudaBackendCompiled()) {
    auto cuda = CreateCudaBackend(options.cuda_device, backend);
    if (cuda.ok()) return cuda;
    spdlog::info("cuda backend unavailable ({}); using the cpu backend", cuda.status().ToString());
  }
  return CreateCpuBackend(options.cpu_threads, backend);
}

// A node session's options common to every mode that keeps K/V on CPU nodes (hybrid, exact):
// the model's geometry, the block size when valid (16..256; 0 leaves the node's default), the
// deadlines, the placement and its re-planning.
RemoteKvOptions NodeSessionOptions(const EngineOptions& options, const ModelConfig& c,
                                   DType kv_dtype, std::string session_id) {
  RemoteKvOptions ro;
  ro.session_id = std::move(session_id);
  ro.num_layers = c.num_layers;
  ro.num_q_heads = c.num_q_heads;
  ro.num_kv_heads = c.num_kv_heads;
  ro.head_dim = c.head_dim;
  ro.kv_dtype = kv_dtype;
  ro.block_tokens = options.block_tokens >= 16 && options.block_tokens <= 256
                        ? static_cast<uint32_t>(options.block_tokens)
                        : 0;
  ro.attend_deadline_ms = options.attend_deadline_ms;
  ro.control_deadline_ms = options.control_deadline_ms;
  ro.placement = options.placement;
  ro.replan_every_steps = options.replan_every_steps;
  ro.replan_min_gain = options.replan_min_gain;
  return ro;
}

// The start-up line of --quantization fp8 on a float checkpoint: what it did to the weights.
void LogQuantizedAtLoad(const ModelWeights& w, const DeviceModel& device, const Backend& backend) {
  if (!w.quantize_at_load) return;
  ModelWeights as_stored = w;  // the float checkpoint's upload, for its bytes
  as_stored.quantize_at_load = false;
  const std::string what =
      absl::StrCat("quantized ", 7 * w.layers.size(), " projections to FP8 at load: weights ",
                   FormatBytes(DeviceModel::WeightBytes(as_stored, backend)), " -> ",
                   FormatBytes(device.weight_bytes()));
  if (DeviceModel::KeepsFp8(w, backend)) {
    spdlog::info("{} (e4m3 codes + f32 row scales)", what);
  } else {
    spdlog::info(
        "{} (dequantized to {} on upload: FP8's values, not its memory; FP8 weights stay "
        "FP8 on the cuda backend with bf16 tables, here {} with {})",
        what, DTypeName(w.dtype), backend.name(), DTypeName(w.dtype));
  }
}

}  // namespace

RunnerOptions EngineRunnerOptions(const EngineOptions& options) {
  RunnerOptions runner;
  runner.max_chunk = options.prefill_chunk;
  runner.maw_alpha = options.maw_alpha;
  runner.measure_captured_mass = options.measure_captured_mass;
  runner.settle_tokens_per_step = options.settle_tokens_per_step;
  runner.speculate_pages = options.page_speculate;
  runner.pass_breaks = options.prefill_breaks;
  return runner;
}

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
  engine->sessions_ = std::make_unique<SessionTable>(options.max_sessions);
  if (options.prefix_cache_min_tokens < 1) {
    return absl::InvalidArgumentError("prefix_cache_min_tokens must be >= 1");
  }
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
    TANDEM_RETURN_IF_ERROR(ApplyQuantizationOption(options.quantization, &engine->model_->config));
    engine->model_->weights.dtype = engine->model_->config.weight_dtype;
  } else {
    TANDEM_ASSIGN_OR_RETURN(engine->model_,
                            LoadModel(options.model_dir, {.quantization = options.quantization}));
  }
  TANDEM_ASSIGN_OR_RETURN(engine->tokenizer_, LoadTokenizer(options.model_dir));
  engine->max_token_bytes_ = MaxTokenBytes(*engine->tokenizer_);
  TANDEM_ASSIGN_OR_RETURN(engine->chat_, LoadChatConfig(options.model_dir));
  engine->eos_sorted_ = engine->tokenizer_->eos_ids();
  std::sort(engine->eos_sorted_.begin(), engine->eos_sorted_.end());
  const ModelConfig& c = engine->model_->config;
  TANDEM_RETURN_IF_ERROR(ValidateLowRankOptions(options.page_low_rank, c.head_dim));
  if (engine->tokenizer_->vocab_size() > c.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("the tokenizer has ", engine->tokenizer_->vocab_size(),
                     " tokens but the model's vocabulary is ", c.vocab_size));
  }
  // The positions the model runs faithfully (model_config.h): max_position_embeddings, extended
  // by a yarn / dynamic / linear rope scaling, capped at a sliding window.
  engine->max_context_ = ModelContextLimit(c);
  if (c.sliding_window > 0 && engine->max_context_ == c.sliding_window) {
    spdlog::warn(
        "the model uses sliding-window attention ({} tokens), which tandem runs as full "
        "attention: the two agree up to the window, so contexts are capped at {} tokens",
        c.sliding_window, c.sliding_window);
  }
  if (options.max_context > 0) engine->max_context_ = std::min(engine->max_context_, options.max_context);
  TANDEM_ASSIGN_OR_RETURN(engine->kv_dtype_,
                          ResolveKvDType(options.kv_dtype, engine->model_->weights.dtype));
  TANDEM_ASSIGN_OR_RETURN(engine->backend_, MakeBackend(options));
  engine->options_.prefix_cache_host_bytes =
      ParkingBudgetBytes(options, std::string(engine->backend_->name()));
  KvCacheOptions cache_options;
  cache_options.block_tokens = options.block_tokens;
  cache_options.min_tokens = options.prefix_cache_min_tokens;
  cache_options.host_bytes = *engine->options_.prefix_cache_host_bytes;
  Engine* self = engine.get();
  engine->kv_cache_ = std::make_unique<KvCacheManager>(
      *engine->backend_, *engine->sessions_, cache_options,
      [self](size_t bytes) { return self->CheckDeviceKv(bytes); });
  if (options.prefix_cache && *engine->options_.prefix_cache_host_bytes > 0) {
    spdlog::info("prefix cache: cached sessions the device needs room from are parked in up to "
                 "{} of host memory",
                 FormatBytes(*engine->options_.prefix_cache_host_bytes));
  }
  {
    // Refuse what cannot fit the device before the weights go up (memory_plan.h).
    TANDEM_ASSIGN_OR_RETURN(const MemoryPlanSetup setup,
                            SetupBeforeLoad(options, *engine->model_, *engine->backend_));
    TANDEM_RETURN_IF_ERROR(CheckWorkerFits(setup));
  }
  if (options.random_weights) {
    TANDEM_ASSIGN_OR_RETURN(engine->device_model_,
                            DeviceModel::CreateRandom(c, *engine->backend_, options.random_seed));
  } else {
    TANDEM_ASSIGN_OR_RETURN(engine->device_model_,
                            DeviceModel::Upload(*engine->model_, *engine->backend_));
    LogQuantizedAtLoad(engine->model_->weights, *engine->device_model_, *engine->backend_);
  }
  TANDEM_ASSIGN_OR_RETURN(engine->runner_, ModelRunner::Create(*engine->backend_,
                                                               *engine->device_model_,
                                                               EngineRunnerOptions(options)));
  engine->token_output_ = std::make_unique<TokenOutput>(*engine->backend_, *engine->tokenizer_,
                                                        c.vocab_size, engine->max_context_);
  TANDEM_ASSIGN_OR_RETURN(engine->nodes_, NodePool::Create(options.nodes));
  // Session ids on CPU nodes are shared by every worker using them: prefix ours uniquely.
  std::random_device rd;
  engine->id_prefix_ = absl::StrFormat("w%d-%08x", static_cast<int>(getpid()), rd());
  return engine;
}

Engine::~Engine() {
  // Close sessions while the node pool (and an embedded node) and the parking pool still exist.
  if (sessions_ != nullptr) sessions_->Clear();
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
  if (!(policy.centroid_share >= 0.0 && policy.centroid_share <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("centroid_share must be in [0, 1], got ", policy.centroid_share));
  }
  return absl::OkStatus();
}

size_t Engine::PageSummaryBytes() const {
  size_t bytes = 0;
  for (const auto& [id, seq] : sessions_->all()) {
    if (const PageIndex* pages = PagesOf(*seq); pages != nullptr) bytes += pages->device_bytes();
  }
  return bytes;
}

absl::Status Engine::CheckPageSummaries(int64_t expected_offloaded, size_t need,
                                        size_t others) const {
  if (options_.page_summary_bytes == 0 || others + need <= options_.page_summary_bytes) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "page summaries for ", expected_offloaded, " offloaded tokens need ", FormatBytes(need),
      " of device memory (", options_.page_tokens, "-token pages), and ", FormatBytes(others),
      " of the worker's ", FormatBytes(options_.page_summary_bytes),
      " for page summaries are in use: ask for fewer tokens, wait for other sessions to end, "
      "use selection=maw, or start the worker with larger --page_tokens or "
      "--page_summary_bytes"));
}

absl::Status Engine::ReservePages(Sequence& seq, int64_t expected_offloaded) const {
  PageIndex* index = PagesOf(seq);
  if (index == nullptr) return absl::OkStatus();
  const int64_t page = options_.page_tokens;
  const int64_t pages = (expected_offloaded + page - 1) / page;
  if (pages <= index->capacity_pages()) return absl::OkStatus();
  const size_t need =
      PageIndex::BytesFor(index->geometry(), page, expected_offloaded, options_.page_low_rank);
  TANDEM_RETURN_IF_ERROR(CheckPageSummaries(expected_offloaded, need,
                                            PageSummaryBytes() - index->device_bytes()));
  return index->Reserve(pages);
}

WindowGeometry Engine::window_geometry() const {
  const ModelConfig& c = model_->config;
  return {c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype_};
}

WindowOptions Engine::WindowOptionsFor(const SequenceSpec& spec, int64_t planned_positions) const {
  return SequenceWindowOptions(options_, max_context_, TraitsOf(spec.mode, spec.selection),
                               spec.window, spec.sink, planned_positions);
}

absl::Status Engine::CheckDeviceKv(size_t more) const {
  if (options_.kv_cache_bytes == 0 || more == 0) return absl::OkStatus();
  const size_t used = DeviceKvBytes();
  if (used + more <= options_.kv_cache_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the request needs ", FormatBytes(more), " more of device KV (window and page summaries "
      "for its prompt + max_tokens) and ", FormatBytes(used), " of the worker's ",
      FormatBytes(options_.kv_cache_bytes), " are in use: ask for fewer tokens, use a smaller window or hybrid mode, wait for other "
      "sessions to end, or start the worker with a larger --kv_cache_bytes"));
}

void Engine::WidenForPrefill(Sequence& seq, int64_t prompt_tokens) {
  WindowCache& window = seq.window;
  seq.prefill_end = window.next_position() + prompt_tokens;
  if (!options_.device_prefill || window.options().window == WindowOptions::kUnlimited) return;
  const int64_t wanted = window.recent_tokens() + prompt_tokens;
  if (wanted <= window.configured_window()) return;
  // A new session's prompt may fit only in part and spill to host pages (PrefillSpillTier, where
  // the tier spills), which stream through the runner's page streamer: it is made before the
  // widening takes what the device has left (without --kv_cache_bytes, all of it).
  const bool may_spill = TraitsOf(seq).spills_prefill &&
                         seq.offload != nullptr && seq.offload->offloaded_tokens() == 0;
  bool can_spill = may_spill;
  if (may_spill) {
    if (absl::Status made = HostPageStreams::Of(runner_->tier_context(), window.geometry(),
                                                options_.offload_page_tokens)
                                .status();
        !made.ok()) {
      spdlog::warn("session {}: prefill spill to host memory off: {}", seq.id, made.ToString());
      can_spill = false;
    }
  }
  // Within the free part of the budget: the widened bytes count in DeviceKvBytes while they
  // are held, so concurrent prefills share what is left and never pass it. Without a budget
  // the device decides (WidenWithin narrows the widening while allocations fail).
  size_t free = std::numeric_limits<size_t>::max();
  if (options_.kv_cache_bytes > 0) {
    const size_t used = DeviceKvBytes();
    free = used < options_.kv_cache_bytes ? options_.kv_cache_bytes - used : 0;
  }
  absl::StatusOr<int64_t> widened = window.WidenWithin(wanted, free);
  if (!widened.ok()) {
    spdlog::warn("session {}: device prefill off for this prompt: {}", seq.id,
                 widened.status().ToString());
    return;
  }
  // Part of the prompt leaves the device during the prefill: a new hybrid session's chunks
  // attend over it from pinned host pages on the device instead of on the CPU nodes.
  if (*widened < wanted && can_spill) {
    absl::StatusOr<std::unique_ptr<OffloadedKv>> kv =
        OffloadedKv::Create(*backend_, window.geometry(), options_.offload_page_tokens);
    if (!kv.ok()) {
      spdlog::warn("session {}: prefill spill to host memory off: {}", seq.id,
                   kv.status().ToString());
      return;
    }
    seq.offload = std::make_unique<PrefillSpillTier>(std::move(seq.offload),
                                                     std::make_unique<HostTier>(std::move(*kv)));
  }
}

absl::StatusOr<std::unique_ptr<Sequence>> Engine::NewSequence(const std::string& id,
                                                              const SequenceSpec& spec,
                                                              int64_t planned_positions,
                                                              int64_t expected_offloaded) {
  const ModelConfig& c = model_->config;
  const WindowGeometry geometry = window_geometry();
  TANDEM_ASSIGN_OR_RETURN(WindowCache cache, WindowCache::Create(*backend_, geometry,
                                                                 WindowOptionsFor(spec, planned_positions)));
  auto seq = std::make_unique<Sequence>(id, spec.mode, std::move(cache));
  const TierTraits traits = TraitsOf(spec.mode, spec.selection);
  if (traits.page_summaries) {
    TANDEM_RETURN_IF_ERROR(CheckPageSummaries(
        expected_offloaded,
        PageIndex::BytesFor(geometry, options_.page_tokens, expected_offloaded,
                            options_.page_low_rank),
        PageSummaryBytes()));
  }
  if (!traits.windowed) return seq;   // no tier: every position stays in the window
  // Every option of every tier; OpenOffloadTier gives each tier the ones it reads.
  TierSpec tier;
  tier.mode = spec.mode;
  tier.geometry = geometry;
  // The node session (hybrid; exact opens it dense, ExactTier: no selection).
  tier.node = NodeSessionOptions(options_, c, kv_dtype_, absl::StrCat(id_prefix_, ".", id));
  tier.node.beta = spec.beta;
  tier.node.expected_tokens = expected_offloaded;
  tier.node.selection = traits.page_summaries ? SelectionRule::kPages : SelectionRule::kMaw;
  tier.node.page_tokens = static_cast<uint32_t>(options_.page_tokens);
  tier.summary_tokens = expected_offloaded;
  tier.low_rank = options_.page_low_rank;
  tier.host_page_tokens = options_.offload_page_tokens;
  // The exact planner's split.
  const size_t kv_bytes = DTypeBytes(kv_dtype_);
  tier.exact.geometry = {c.num_layers, c.num_kv_heads, c.head_dim, c.hidden_size, kv_bytes,
                         kv_bytes};
  tier.exact.expected_tokens = expected_offloaded;
  tier.exact.plan.force_fetch_share = options_.exact_fetch_share;
  tier.exact.plan.allow_recompute = options_.exact_recompute;
  tier.exact.model = device_model_.get();
  tier.exact.replan_every_steps = options_.replan_every_steps;
  if (traits.measures_rates && exact_rates_ == nullptr) {
    TANDEM_ASSIGN_OR_RETURN(exact_rates_, ExactRateBook::Measure(*backend_, *nodes_,
                                                                 tier.exact.geometry, kv_dtype_));
  }
  tier.exact_rates = exact_rates_.get();
  // Lost CPU nodes' entries are rebuilt from K/V recomputed here (kv_recompute.h).
  auto device_room = [this](size_t bytes) { return CheckDeviceKv(bytes); };
  tier.node_recompute = MakeRecomputeKv(*runner_, *seq, options_.prefill_chunk, device_room);
  tier.exact_recompute = MakeRecomputeAt(*runner_, *seq, options_.prefill_chunk, device_room);
  if (traits.streams_host_pages) {
    // Before this session's prompt widens its window (WidenForPrefill).
    TANDEM_RETURN_IF_ERROR(
        HostPageStreams::Of(runner_->tier_context(), geometry, options_.offload_page_tokens)
            .status());
  }
  TANDEM_ASSIGN_OR_RETURN(seq->offload, OpenOffloadTier(*backend_, nodes_.get(), tier));
  // A pages tier chooses within the request's budget (later turns may change it).
  if (PagePolicy* policy = seq->offload->page_policy()) *policy = spec.page_policy;
  return seq;
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
  const std::string id = "eval-" + sessions_->NewAnonymousId();
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
  return EncodePrompt(*tokenizer_, text, add_bos);
}

std::string Engine::Detokenize(const std::vector<int32_t>& ids) const {
  return tokenizer_->Decode(ids);
}

absl::Status Engine::CloseSession(const std::string& session_id) {
  if (!sessions_->contains(session_id)) {
    if (sessions_->lost().Forget(session_id)) return absl::OkStatus();   // closed already
    return absl::NotFoundError(absl::StrCat("no session '", session_id, "'"));
  }
  kv_cache_->Take(session_id);
  return sessions_->Close(session_id);
}

void Engine::CloseLostSession(const std::string& id, const std::string& reason) {
  kv_cache_->Take(id);
  sessions_->CloseLost(id, reason);
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
  info.chat_template = chat_.chat_template;
  info.bos_token = chat_.bos_token;
  info.eos_token = chat_.eos_token;
  info.eos_token_ids = eos_sorted_;
  info.sampling_defaults = model_->config.sampling_defaults;
  return info;
}

}  // namespace tandem::gpu_worker
