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
#include "tandem/gpu_worker/host_tier.h"
#include "tandem/gpu_worker/kv_recompute.h"
#include "tandem/gpu_worker/memory_plan.h"
#include "tandem/gpu_worker/node_tier.h"
#include "tandem/gpu_worker/prefill_spill_tier.h"
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
  engine->lost_sessions_ = LostSessions(options.max_sessions);
  engine->prefix_cache_ = PrefixCache(options.block_tokens);
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
    engine->model_->weights.dtype = engine->model_->config.weight_dtype;
  } else {
    TANDEM_ASSIGN_OR_RETURN(engine->model_, LoadModel(options.model_dir));
  }
  TANDEM_ASSIGN_OR_RETURN(engine->tokenizer_, LoadTokenizer(options.model_dir));
  engine->max_token_bytes_ = MaxTokenBytes(*engine->tokenizer_);
  TANDEM_ASSIGN_OR_RETURN(engine->chat_, LoadChatConfig(options.model_dir));
  engine->eos_sorted_ = engine->tokenizer_->eos_ids();
  std::sort(engine->eos_sorted_.begin(), engine->eos_sorted_.end());
  const ModelConfig& c = engine->model_->config;
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
  if (!options.prefix_cache_host_bytes.has_value()) {
    size_t host = 0;
    const long pages = sysconf(_SC_PHYS_PAGES), page_bytes = sysconf(_SC_PAGESIZE);
    if (engine->backend_->name() == "cuda" && pages > 0 && page_bytes > 0) {
      host = static_cast<size_t>(pages) * static_cast<size_t>(page_bytes) / 4;
    }
    engine->options_.prefix_cache_host_bytes = host;
  }
  engine->parking_ = std::make_unique<ParkingPool>(*engine->backend_,
                                                   *engine->options_.prefix_cache_host_bytes);
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
  }
  RunnerOptions runner_options;
  runner_options.max_chunk = options.prefill_chunk;
  runner_options.maw_alpha = options.maw_alpha;
  runner_options.measure_captured_mass = options.measure_captured_mass;
  runner_options.settle_tokens_per_step = options.settle_tokens_per_step;
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
        "page summaries for ", expected_offloaded, " offloaded tokens need ", FormatBytes(need),
        " of device memory (", page, "-token pages), and ", FormatBytes(others), " of the worker's ",
        FormatBytes(options_.page_summary_bytes),
        " for page summaries are in use: ask for fewer tokens, wait for other sessions to end, "
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
  return SequenceWindowOptions(options_, max_context_, spec.mode, spec.window, spec.sink,
                               planned_positions);
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
  // A new hybrid session's prompt may fit only in part and spill to host pages
  // (PrefillSpillTier), which stream through the runner's page streamer: it is made before the
  // widening takes what the device has left (without --kv_cache_bytes, all of it).
  const bool may_spill = seq.mode == AttentionMode::kHybrid && seq.offload != nullptr &&
                         seq.offload->offloaded_tokens() == 0;
  bool can_spill = may_spill;
  if (may_spill) {
    if (absl::Status made = runner_->PrepareHostStreaming(window.geometry(),
                                                          options_.offload_page_tokens);
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

void Engine::EndPrefillSpill(Sequence& seq) {
  if (auto* spill = dynamic_cast<PrefillSpillTier*>(seq.offload.get()); spill != nullptr) {
    seq.offload = spill->TakeInner();
  }
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
    RemoteKvOptions ro =
        NodeSessionOptions(options_, c, kv_dtype_, absl::StrCat(id_prefix_, ".", id));
    ro.beta = beta;
    ro.expected_tokens = expected_offloaded;
    ro.selection = seq->selection;
    ro.page_tokens = static_cast<uint32_t>(options_.page_tokens);
    TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<RemoteKv> remote, RemoteKv::Open(*nodes_, ro));
    auto tier = std::make_unique<NodeTier>(std::move(remote), std::move(pages));
    // Shards lost with a CPU node are rebuilt from K/V recomputed here (kv_recompute.h).
    tier->set_recompute(MakeRecomputeKv(*runner_, *seq, options_.prefill_chunk,
                                        [this](size_t bytes) { return CheckDeviceKv(bytes); }));
    seq->offload = std::move(tier);
  }
  if (mode == AttentionMode::kOffload || mode == AttentionMode::kExact) {
    // Before this session's prompt widens its window (WidenForPrefill).
    TANDEM_RETURN_IF_ERROR(
        runner_->PrepareHostStreaming(geometry, options_.offload_page_tokens));
  }
  if (mode == AttentionMode::kOffload) {
    TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<OffloadedKv> kv,
                            OffloadedKv::Create(*backend_, geometry, options_.offload_page_tokens));
    seq->offload = std::make_unique<HostTier>(std::move(kv));
  }
  if (mode == AttentionMode::kExact) {
    const size_t kv_bytes = DTypeBytes(kv_dtype_);
    ExactTierOptions eo;
    eo.geometry = {c.num_layers, c.num_kv_heads, c.head_dim, c.hidden_size, kv_bytes, kv_bytes};
    eo.expected_tokens = expected_offloaded;
    eo.plan.force_fetch_share = options_.exact_fetch_share;
    eo.plan.allow_recompute = options_.exact_recompute;
    eo.model = device_model_.get();
    eo.replan_every_steps = options_.replan_every_steps;
    if (exact_rates_ == nullptr) {
      TANDEM_ASSIGN_OR_RETURN(exact_rates_,
                              ExactRateBook::Measure(*backend_, *nodes_, eo.geometry, kv_dtype_));
    }
    const RemoteKvOptions ro =
        NodeSessionOptions(options_, c, kv_dtype_, absl::StrCat(id_prefix_, ".", id));
    TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<ExactTier> tier,
                            OpenExactTier(*backend_, *nodes_, *exact_rates_, ro, geometry,
                                          options_.offload_page_tokens, eo));
    // What a lost CPU node held is rebuilt from K/V recomputed here (exact_rebuild.h).
    tier->set_recompute(MakeRecomputeAt(*runner_, *seq, options_.prefill_chunk,
                                        [this](size_t bytes) { return CheckDeviceKv(bytes); }));
    seq->offload = std::move(tier);
  }
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
  return EncodePrompt(*tokenizer_, text, add_bos);
}

std::string Engine::Detokenize(const std::vector<int32_t>& ids) const {
  return tokenizer_->Decode(ids);
}

absl::Status Engine::CloseSession(const std::string& session_id) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    if (lost_sessions_.Forget(session_id)) return absl::OkStatus();   // closed already
    return absl::NotFoundError(absl::StrCat("no session '", session_id, "'"));
  }
  absl::Status closed = it->second->CloseOffloaded();
  prefix_cache_.Take(session_id);
  kept_scope_.erase(session_id);
  sessions_.erase(it);
  return closed;
}

Engine::CacheScope Engine::PrefixCacheScope(const GenerateRequest& request,
                                            const SequenceSpec& spec) const {
  // Fields joined by a byte no principal, salt or number contains; lengths first, so no two
  // different tuples give one key.
  auto key_of = [&](const std::string& principal) {
    std::string key = absl::StrCat(principal.size(), ":", principal, "\x1f",
                                   request.cache_salt.size(), ":", request.cache_salt, "\x1f",
                                   std::string(AttentionModeName(spec.mode)));
    if (spec.mode != AttentionMode::kGpu) {
      absl::StrAppend(&key, "\x1f", spec.window, "\x1f", spec.sink, "\x1f",
                      spec.selection == SelectionRule::kPages ? "pages" : "maw");
    }
    return key;
  };
  return {key_of(options_.prefix_cache_shared_scope ? "" : request.principal),
          key_of(request.principal)};
}

Sequence* Engine::ReuseCachedPrefix(const CacheScope& scope, const std::vector<int32_t>& prompt,
                                     int64_t planned, int64_t* common, bool* forked) {
  *forked = false;
  auto fork_of = [&](const PrefixCache::Hit& parent) -> Sequence* {
    absl::StatusOr<Sequence*> fork =
        ForkSession(scope.cache, parent.session_id, parent.common, planned);
    if (!fork.ok()) {
      spdlog::debug("prefix cache: no fork of {}: {}", parent.session_id,
                    fork.status().ToString());
      return nullptr;
    }
    *common = parent.common;
    *forked = true;
    return *fork;
  };
  std::optional<PrefixCache::Hit> hit =
      prefix_cache_.Match(scope.cache, prompt, options_.prefix_cache_min_tokens);
  if (hit.has_value() &&
      (sessions_.count(hit->session_id) == 0 || SessionBusy(hit->session_id))) {
    prefix_cache_.Take(hit->session_id);   // not a cached session any more
    hit.reset();
  }
  // A session in use that shares more (a reader of the same document that came just before, or
  // a kept session of the caller's): forked, never taken. The cached hit stays out of the cache
  // meanwhile, so that the fork's room is not made by evicting it.
  if (const std::optional<PrefixCache::Hit> in_use = InUsePrefix(scope, prompt);
      in_use.has_value() && (!hit.has_value() || in_use->common > hit->common)) {
    const bool hit_held = hit.has_value() && prefix_cache_.Take(hit->session_id);
    Sequence* fork = fork_of(*in_use);
    if (hit_held && sessions_.count(hit->session_id) > 0) {
      prefix_cache_.Insert(hit->session_id, scope.cache, sessions_.at(hit->session_id)->tokens);
    }
    if (fork != nullptr) return fork;
  }
  // (A failed fork may have closed sessions: look the hit up again.)
  if (!hit.has_value() || sessions_.count(hit->session_id) == 0) return nullptr;
  // A parked hit comes back over PCIe first (both ways below read its window on the device).
  if (sessions_.at(hit->session_id)->parked() &&
      !UnparkCachedSession(scope.cache, hit->session_id)) {
    return nullptr;
  }
  // Continuing in place keeps one copy; a fork keeps the cached tokens the prompt does not share
  // for whoever sends them next (the same document with another question, or the parent's own
  // next turn). A tail shorter than a block is a chat turn re-rendered at its end: not worth a
  // copy.
  const int64_t dropped =
      static_cast<int64_t>(sessions_.at(hit->session_id)->tokens.size()) - hit->common;
  if (dropped >= options_.block_tokens) {
    if (Sequence* fork = fork_of(*hit)) return fork;
    if (sessions_.count(hit->session_id) == 0) return nullptr;
  }
  Sequence& seq = *sessions_.at(hit->session_id);
  if (absl::Status truncated = seq.TruncateTo(hit->common); !truncated.ok()) {
    // Its tokens after the common prefix left the device (a long generation in a bounded
    // window): this prompt cannot reuse it; it stays cached for prompts that extend it.
    spdlog::debug("prefix cache: {}: {}", hit->session_id, truncated.ToString());
    return nullptr;
  }
  prefix_cache_.Take(hit->session_id);
  *common = hit->common;
  return &seq;
}

std::optional<PrefixCache::Hit> Engine::InUsePrefix(const CacheScope& scope,
                                                    const std::vector<int32_t>& prompt) const {
  std::optional<PrefixCache::Hit> best;
  if (prompt.size() < 2) return best;
  auto consider = [&](const std::string& id, const Sequence& seq) {
    if (seq.window.widened()) return;   // a prefill under way: not forkable yet
    if (seq.offload != nullptr && !seq.offload->can_fork()) return;
    if (auto running = busy_.find(id); running != busy_.end() && !running->second->failure.ok()) {
      return;   // failed in this iteration (its state may be inconsistent): End closes it
    }
    const size_t limit = std::min(seq.tokens.size(), prompt.size() - 1);
    size_t common = 0;
    while (common < limit && seq.tokens[common] == prompt[common]) ++common;
    if (static_cast<int64_t>(common) < options_.prefix_cache_min_tokens) return;
    if (!best.has_value() || static_cast<int64_t>(common) > best->common) {
      best = PrefixCache::Hit{id, static_cast<int64_t>(common)};
    }
  };
  for (const auto& [id, g] : busy_) {   // running one-shot requests of the cache scope
    if (g->cache_key == scope.cache && g->seq != nullptr) consider(id, *g->seq);
  }
  // Kept sessions are pinned prefixes of their own principal's scope only (even when one-shot
  // requests share one scope: a conversation is not a cached prompt).
  for (const auto& [id, own] : kept_scope_) {
    auto it = sessions_.find(id);
    if (own == scope.own && it != sessions_.end()) consider(id, *it->second);
  }
  return best;
}

absl::StatusOr<Sequence*> Engine::ForkSession(const std::string& key,
                                              const std::string& parent_id, int64_t common,
                                              int64_t planned) {
  Sequence& parent = *sessions_.at(parent_id);
  // What cannot fork is known before any room is made or anything is moved.
  if (parent.offload != nullptr && !parent.offload->can_fork()) {
    return absl::UnimplementedError("its offload tier does not fork");
  }
  TANDEM_RETURN_IF_ERROR(parent.window.ForkBytes(common, planned).status());
  // A parent still settling its prompt into its tier finishes that first, once: its forks then
  // share the settled entries on the CPU nodes instead of each appending its own copy of them.
  // Not when the settle would take positions at or after `common` off the device (the fork
  // then copies the pending blocks instead). The settle runs here, between steps, at once.
  int64_t settled_end = parent.window.options().sink + parent.window.evicted_tokens();
  for (const EvictedBlock& b : parent.window.PendingEvictions()) settled_end += b.count;
  if (parent.offload != nullptr && parent.window.settling() && common >= settled_end) {
    if (absl::Status settled = runner_->SettleEvictions(parent); !settled.ok()) {
      // As a failed settle slice: the parent's state is no longer consistent.
      const std::string why = absl::StrCat("its prompt's move to the KV tier before a fork "
                                           "failed: ", settled.ToString());
      if (auto running = busy_.find(parent_id); running != busy_.end()) {
        running->second->failure = absl::InternalError(why);   // End closes it
      } else {
        CloseLostSession(parent_id, why);
      }
      return absl::FailedPreconditionError(absl::StrCat("no fork of ", parent_id, ": ", why));
    }
  }
  // A cached parent is out of the cache while room is made, so that the room is not made by
  // evicting it; back in afterwards as the most recently used (a document others are reading).
  const bool cached = prefix_cache_.Take(parent_id);
  auto recache = absl::MakeCleanup([&] {
    if (cached) prefix_cache_.Insert(parent_id, key, parent.tokens);
  });
  while (sessions_.size() >= options_.max_sessions) {
    if (!CloseLeastRecentlyCached()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("all ", options_.max_sessions, " sessions are in use"));
    }
  }
  const std::string id = absl::StrCat("anon-", next_anonymous_id_++);
  const WindowOptions& wo = parent.window.options();
  const int64_t expected_offloaded =
      wo.window == WindowOptions::kUnlimited ? 0
                                             : std::max<int64_t>(0, planned - wo.window - wo.sink);
  TANDEM_ASSIGN_OR_RETURN(size_t device_bytes, parent.window.ForkBytes(common, planned));
  if (parent.pages != nullptr) {
    device_bytes += PageIndex::BytesFor(window_geometry(), parent.pages->page_tokens(),
                                        std::max(expected_offloaded, parent.offloaded_entries()));
  }
  auto tier_fork = [&](Sequence& fork) {
    return TierFork{absl::StrCat(id_prefix_, ".", id), expected_offloaded,
                    MakeRecomputeKv(*runner_, fork, options_.prefill_chunk,
                                    [this](size_t bytes) { return CheckDeviceKv(bytes); })};
  };
  std::unique_ptr<Sequence> fork;
  TANDEM_RETURN_IF_ERROR(WithCacheEviction([&]() -> absl::Status {
    TANDEM_RETURN_IF_ERROR(CheckDeviceKv(device_bytes));
    TANDEM_ASSIGN_OR_RETURN(fork, parent.Fork(id, common, planned, tier_fork));
    return absl::OkStatus();
  }));
  Sequence* seq = fork.get();
  sessions_[id] = std::move(fork);
  return seq;
}

bool Engine::EvictCachedSession() {
  const std::optional<std::string> lru =
      prefix_cache_.LeastRecentlyUsed([&](const std::string& id) {
        auto it = sessions_.find(id);
        return it == sessions_.end() || !it->second->parked();
      });
  if (!lru.has_value()) return false;
  if (!ParkCachedSession(*lru)) CloseCachedSession(*lru);
  return true;
}

bool Engine::CloseLeastRecentlyCached() {
  const std::optional<std::string> lru = prefix_cache_.LeastRecentlyUsed();
  if (!lru.has_value()) return false;
  CloseCachedSession(*lru);
  return true;
}

bool Engine::ParkCachedSession(const std::string& id) {
  auto it = sessions_.find(id);
  if (parking_->max_bytes() == 0 || it == sessions_.end()) return false;
  Sequence& seq = *it->second;
  if (parking_->PagesFor(seq.ParkBytes()) * parking_->page_bytes() > parking_->max_bytes()) {
    return false;
  }
  auto is_parked = [&](const std::string& other) {
    auto o = sessions_.find(other);
    return o != sessions_.end() && o->second->parked();
  };
  for (;;) {
    const absl::Status parked = seq.Park(*parking_);
    if (parked.ok()) break;
    // The pool is full: the least recently used parked session makes room.
    const std::optional<std::string> oldest =
        absl::IsResourceExhausted(parked) ? prefix_cache_.LeastRecentlyUsed(is_parked)
                                          : std::nullopt;
    if (!oldest.has_value()) {
      spdlog::debug("prefix cache: {} not parked: {}", id, parked.ToString());
      return false;
    }
    CloseCachedSession(*oldest);
  }
  ++prefix_cache_parks_;
  return true;
}

bool Engine::UnparkCachedSession(const std::string& key, const std::string& id) {
  Sequence& seq = *sessions_.at(id);
  // Out of the cache while room is made, so that the room is not made by closing it (to park
  // another session in its host room); back in as the most recently used.
  const bool cached = prefix_cache_.Take(id);
  auto recache = absl::MakeCleanup([&] {
    if (cached) prefix_cache_.Insert(id, key, seq.tokens);
  });
  const absl::Status unparked = WithCacheEviction([&]() -> absl::Status {
    TANDEM_RETURN_IF_ERROR(CheckDeviceKv(seq.resident_bytes()));
    return seq.Unpark();
  });
  if (unparked.ok()) {
    ++prefix_cache_unparks_;
    return true;
  }
  spdlog::info("prefix cache: {} stays parked: {}", id, unparked.ToString());
  if (!absl::IsResourceExhausted(unparked)) {
    std::move(recache).Cancel();   // a failed copy: its state is not to be trusted
    CloseCachedSession(id);
  }
  return false;
}

void Engine::CloseCachedSession(const std::string& id) {
  prefix_cache_.Take(id);
  auto it = sessions_.find(id);
  if (it != sessions_.end()) {
    if (absl::Status closed = it->second->CloseOffloaded(); !closed.ok()) {
      spdlog::warn("prefix cache: evicting {}: {}", id, closed.ToString());
    }
    sessions_.erase(it);
  }
  ++prefix_cache_evictions_;
}

size_t Engine::parked_sessions() const {
  size_t count = 0;
  for (const auto& [id, seq] : sessions_) count += seq->parked() ? 1 : 0;
  return count;
}

size_t Engine::CachedDeviceBytes() const {
  size_t bytes = 0;
  for (const auto& [id, seq] : sessions_) {
    if (!prefix_cache_.contains(id)) continue;
    bytes += seq->window.device_bytes() + (seq->pages ? seq->pages->device_bytes() : 0);
  }
  return bytes;
}

size_t Engine::ParkedBytes() const { return parking_->in_use_bytes(); }

absl::Status Engine::WithCacheEviction(const std::function<absl::Status()>& attempt) {
  absl::Status status = attempt();
  // Parking frees device memory only; when the room is short elsewhere (a CPU node's pool, host
  // pages) nothing left to park, the least recently used cached sessions are closed.
  while (absl::IsResourceExhausted(status) &&
         (EvictCachedSession() || CloseLeastRecentlyCached())) {
    status = attempt();
  }
  return status;
}

void Engine::CloseLostSession(const std::string& id, const std::string& reason) {
  prefix_cache_.Take(id);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  spdlog::warn("session {}: closed, {}", id, reason);
  (void)it->second->CloseOffloaded();
  kept_scope_.erase(id);
  sessions_.erase(it);
  lost_sessions_.Remember(id, reason);
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
