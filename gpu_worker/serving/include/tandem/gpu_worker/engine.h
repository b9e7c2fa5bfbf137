// Engine: the GPU worker's generation logic: the model on a backend, the CPU attention nodes,
// and each request from admission to its summary. It owns the open sessions (SessionTable), the
// prefix cache over them with its tiers and eviction (KvCacheManager), the tier each new
// session's offloaded KV lives in (OpenOffloadTier) and what becomes of each logits row
// (TokenOutput: sampling, logprobs, detokenization, stops). The Generation service and the CLI
// are thin layers over it.
//
// Many requests run at once: Begin() admits one (a Generation), Step() advances a batch of
// them in one forward pass (decode tokens and prefill chunks together), End() reports one.
// Generate() is the three for a single request. The Scheduler (scheduler.h) decides what each
// step feeds.
//
// Not thread-safe: exactly one thread (the scheduler's, which owns the backend, STYLE.md "the
// GPU worker has one executor thread that owns the CUDA context") calls an Engine.
//
// Errors: INVALID_ARGUMENT for a bad request (the message names the field), NOT_FOUND for an
// unknown session, RESOURCE_EXHAUSTED when sessions or memory run out, UNAVAILABLE when CPU
// nodes cannot be reached at session start. A failed request leaves the engine serving.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/chat_config.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/exact_probe.h"
#include "tandem/gpu_worker/generate_request.h"
#include "tandem/gpu_worker/generation.h"
#include "tandem/gpu_worker/kv_cache_manager.h"
#include "tandem/gpu_worker/low_rank_index.h"
#include "tandem/gpu_worker/model_runner.h"
#include "tandem/gpu_worker/model_weights.h"
#include "tandem/gpu_worker/node_pool.h"
#include "tandem/gpu_worker/prefix_cache.h"
#include "tandem/gpu_worker/remote_kv.h"
#include "tandem/gpu_worker/sequence.h"
#include "tandem/gpu_worker/session_table.h"
#include "tandem/gpu_worker/token_output.h"
#include "tandem/gpu_worker/tokenizer.h"

namespace tandem::gpu_worker {

struct EngineOptions {
  std::string model_dir;
  // Serve model_dir's geometry (config.json) and tokenizer with synthetic weights made on the
  // device (DeviceModel::CreateRandom, seeded): benchmarks of models whose weights are not at
  // hand. The text it generates means nothing; speed and memory are the real model's.
  bool random_weights = false;
  uint64_t random_seed = 0;
  // --quantization: "" / "none" (the checkpoint's weights as they are) or "fp8" (a bf16 or f32
  // checkpoint's projections quantized to FP8 per output row at load, kept FP8 on cuda; an FP8
  // checkpoint as it is; random weights made FP8): LoadOptions::quantization (model_weights.h).
  std::string quantization;
  std::string backend = "auto";    // "auto" (cuda when a GPU is usable, else cpu), "cpu", "cuda"
  int cuda_device = 0;
  unsigned cpu_threads = 0;        // cpu backend threads; 0 = all usable cores
  // The backend's options (prefill attention kernel: fast or exact; backend.h).
  BackendOptions backend_options;
  int64_t prefill_chunk = 512;     // tokens per forward chunk
  float maw_alpha = 0.1f;
  bool measure_captured_mass = false;   // RunnerOptions::measure_captured_mass (benchmarks)
  // Most positions of a session (prompt + generated, all turns); 0 = the model's context,
  // ModelContextLimit (max_position_embeddings, extended by a yarn / dynamic / linear rope
  // scaling, capped at a sliding window). Also sizes the device KV of `gpu` mode sessions.
  int64_t max_context = 0;
  // KV dtype on the device and the CPU nodes: "auto" (bf16 for bf16/f16 models, f32 for f32
  // models), "bf16" or "f32".
  std::string kv_dtype = "auto";
  int64_t block_tokens = 16;       // tokens per evicted block (and per CPU node block when >= 16)
  // Sessions open at once: kept ones, running requests' and the prefix cache's (which are
  // evicted first when a request needs the room).
  uint32_t max_sessions = 64;
  // Automatic prefix caching (prefix_cache.h): a one-shot request's session stays cached when it
  // ends (prompt and generated tokens, wherever its mode keeps KV), and a later one-shot request
  // of the same scope whose prompt shares at least prefix_cache_min_tokens leading ids with it
  // continues it, prefilling only the rest. Cached sessions are evicted least-recently-used
  // before a request would be refused for memory or max_sessions. false: one-shot requests free
  // their KV when they end.
  bool prefix_cache = false;
  int64_t prefix_cache_min_tokens = 16;
  // true: one scope for every caller (GenerateRequest::principal is ignored; cache_salt still
  // separates); false: the caller's principal is part of the scope.
  bool prefix_cache_shared_scope = false;
  // Host bytes (pinned on cuda) for cached sessions parked off the device: when a request needs
  // device memory, the least recently used cached session's window and page summaries move
  // here instead of being closed (Sequence::Park) and come back over PCIe when a prompt hits
  // it; the least recently used parked sessions are closed to make room. Its offloaded KV stays
  // on its tier (CPU nodes, host pages). 0 = cached sessions are closed when the device needs
  // their memory. Unset: a quarter of the host's physical memory on the cuda backend, 0 on the
  // cpu backend (its device memory is host memory: parking would free nothing). Engine::options()
  // reports the value in use.
  std::optional<size_t> prefix_cache_host_bytes;
  int64_t offload_page_tokens = 4096;   // `offload` mode: tokens per host page (one upload)
  // Defaults of requests that leave the tandem fields unset.
  AttentionMode default_mode = AttentionMode::kHybrid;
  float default_beta = 1.0f;
  int64_t default_window = 1024;
  int64_t default_sink = 4;
  SelectionRule default_selection = SelectionRule::kMaw;
  PagePolicy default_page_policy;
  // selection = pages: entries per page (summary granularity; must divide block_tokens for
  // pages to be used).
  int64_t page_tokens = 16;
  // selection = pages: every offloaded key's low-rank coordinates on the device beside the
  // summaries (LowRankIndex; rank + 4 bytes per key and kv head), so that PagePolicy::low_rank
  // can score pages by them. Default: rank head_dim / 2 from each head's first 4,096 offloaded
  // keys; rank 0 turns them off (the second score is then q·mean).
  LowRankOptions page_low_rank{LowRankOptions::kHalfHeadDim, 4096};
  // selection = pages: choose each layer's pages from a guess of its queries made from the
  // layer before (RunnerOptions::speculate_pages), on the device while the host waits for the
  // CPU nodes, instead of from the true queries on the step's serial path. Measured on the H200
  // (BENCHMARKS "Layer-ahead selection"): the 512K step 23.8 -> 15.3 ms; perplexity +0.03% to
  // +0.08% at 32K and +0.13% to +0.17% at 64K over the true queries' pages, needles unchanged.
  // false: the pages of the true queries (exact selection, on the serial path).
  bool page_speculate = true;
  // Breaks in long passes (pass_breaks.h): a step that feeds a prompt chunk lets requests that
  // arrive while it runs start between its layers (their prompts, and the decode rows of those
  // not in it, in an interlude: the Scheduler's), so a short prompt's first token does not wait
  // for a long chunk. Costs [prefill_chunk, hidden] f32 of device memory and one host wait per
  // layer of such passes. Only passes whose attention stays on the device take breaks.
  // Measured on the H200 (BENCHMARKS "Breaks in long passes"): short prompts during a 32K
  // prefill at 1.0x (median) to 1.8x (max) their idle TTFT, the 32K prompt itself unchanged.
  bool prefill_breaks = true;
  // Device bytes all sessions' KV may take together: windows (gpu mode: all of its KV) and page
  // summaries, reserved for each request's prompt + max_tokens when it starts. 0 = no cap but
  // the device's memory. A request that does not fit waits in the scheduler's queue while others
  // run (RESOURCE_EXHAUSTED when it could not fit even alone).
  size_t kv_cache_bytes = 0;
  // Device prefill: a Generate prompt of a bounded-window sequence (hybrid, offload) is fed
  // with its window widened to hold the whole prompt (WindowCache::Widen), as far as
  // kv_cache_bytes and the device allow, so each chunk attends over the prompt's earlier KV on
  // the device; the blocks beyond the configured window go to the tier after the first token,
  // settle_tokens_per_step a step while the request decodes on (its window attends the rest).
  // false: the window keeps its size and each chunk attends over the evicted part through the
  // tier. Evaluate always takes the latter path (it measures the selection's approximation).
  bool device_prefill = true;
  // Most tokens of device-prefilled prompts' blocks that move to their tiers per step, over all
  // sessions (RunnerOptions::settle_tokens_per_step; 0 = a whole prompt at once).
  int64_t settle_tokens_per_step = 1024;
  // A step that fed prompt chunks settles only what the chunks left of settle_tokens_per_step
  // (at least one block): a chunk and a whole slice in one step add up to one long wait for the
  // decoding requests in it (their ITL tail). The settle catches up in decode-only steps.
  bool settle_shares_prefill_budget = true;
  // Device bytes all sessions' page summaries may take together; 0 = no cap but the device's
  // memory. A request whose summaries (for its prompt + max_tokens) do not fit is refused with
  // RESOURCE_EXHAUSTED before anything runs.
  size_t page_summary_bytes = 0;
  // CPU attention nodes (empty addresses and dns_name: one node in-process).
  NodePoolOptions nodes;
  int attend_deadline_ms = 2000;
  int control_deadline_ms = 30000;   // OpenSession, AppendKv, Reselect, CloseSession (ms)
  // Placement of hybrid sessions' shards on the nodes (remote_kv.h): cost-balanced with live
  // re-planning every replan_every_steps decode steps, or the cost-blind uniform spread.
  PlacementPolicy placement = PlacementPolicy::kBalanced;
  int replan_every_steps = 16;
  double replan_min_gain = 0.05;
  // `exact` mode: >= 0 forces the share of offloaded entries streamed from host pages (the rest
  // on the CPU nodes) instead of the planned one (exact_planner.h); tests and benchmarks.
  double exact_fetch_share = -1;
  // `exact` mode: let the planner recompute part of the offloaded K/V from stored layer inputs
  // (KVPR) when its verdict says it pays (MHA models; never GQA such as Llama-3-8B).
  bool exact_recompute = true;
};

// Perplexity-style evaluation of a token sequence (teacher forcing).
// The runner's options of an engine with `options` (what its activations are sized by).
RunnerOptions EngineRunnerOptions(const EngineOptions& options);

struct EvaluateRequest {
  std::vector<int32_t> ids;
  AttentionMode mode = AttentionMode::kGpu;
  float beta = 0.0f;
  int64_t window = 512;
  int64_t sink = 4;
  SelectionRule selection = SelectionRule::kMaw;
  PagePolicy page_policy;
};

struct EvaluateResult {
  double nll_sum = 0.0;            // Σ -log p(ids[i] | ids[<i]) over i >= 1
  int64_t predictions = 0;         // ids.size() - 1
  double perplexity() const { return predictions ? std::exp(nll_sum / predictions) : 0.0; }
  std::vector<double> selected_share;   // hybrid: mean selected/held per layer over the run
  // selection = pages with EngineOptions::measure_captured_mass: mean share of the offloaded
  // softmax mass the chosen pages captured, per layer.
  std::vector<double> captured_mass;
  int64_t cpu_kv_entries = 0;
  uint64_t degraded_steps = 0;
};

struct ModelInfo {
  std::string model_dir;
  std::string model_type;
  std::string backend;             // "cpu" or "cuda"
  std::string device;              // backend device description
  int64_t num_layers = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0, hidden_size = 0;
  int64_t vocab_size = 0;
  int64_t max_context = 0;
  std::string weight_dtype;
  std::string kv_dtype;
  size_t weight_bytes = 0;
  size_t cpu_nodes = 0;
  std::string tokenizer_kind;
  // chat_config.h: the chat template and the BOS / EOS token texts ("" when absent).
  std::string chat_template;
  std::string bos_token;
  std::string eos_token;
  // The ids generation stops at, ascending: config.json's and generation_config.json's
  // eos_token_id and tokenizer_config.json's eos_token (tokenizer.h LoadTokenizer).
  std::vector<int32_t> eos_token_ids;
  SamplingDefaults sampling_defaults;   // generation_config.json's (model_config.h)
};

class Engine {
 public:
  // Loads the model and tokenizer, creates the backend and the CPU node pool.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options);
  ~Engine();

  // Runs one request to its end (Begin, Step until finished, End).
  absl::StatusOr<GenerateSummary> Generate(const GenerateRequest& request,
                                           const GenerateCallbacks& callbacks = {});

  // Validates `request`, opens or continues its session (reserving the device and CPU-node
  // memory it will need by its end) and builds its feed. Errors: as Generate's;
  // RESOURCE_EXHAUSTED when memory or sessions are short (a scheduler may retry once others
  // end); FAILED_PRECONDITION when its session is in use by another generation, or once after
  // the engine closed it (LostSessions).
  absl::StatusOr<std::unique_ptr<Generation>> Begin(GenerateRequest request,
                                                    GenerateCallbacks callbacks,
                                                    Generation::Clock::time_point arrival);
  // One batched forward pass: item b feeds `tokens` of its generation's remaining feed (all of
  // a decode token, or a prefill chunk). Σ tokens <= max_step_tokens(), distinct generations,
  // none finished. Generations whose feed is consumed sample their next token (callbacks run);
  // prefill chunks report progress. A failed pass fails every generation of the batch (their
  // `failure` is set; the Status is also returned).
  struct StepItem {
    Generation* generation = nullptr;
    int64_t tokens = 0;
  };
  // With `breaks` (EngineOptions::prefill_breaks), other work may run between the pass's layers.
  absl::Status Step(const std::vector<StepItem>& items, PassBreaks* breaks = nullptr);
  // Whether a Step over `items` would take breaks (ModelRunner::CanBreak).
  bool StepCanBreak(const std::vector<StepItem>& items) const;
  // Ends `generation` (finished, or stopped early: `cancelled` gives finish reason kCancelled,
  // a past deadline DEADLINE_EXCEEDED): closes its session unless it is kept and consistent,
  // and returns its summary or its failure.
  absl::StatusOr<GenerateSummary> End(Generation& generation);
  // Kept sessions between turns still settling a prompt (device prefill): Step moves a slice
  // of them after its own; with no generation running, the scheduler calls SettleIdle (a slice
  // of settle_tokens_per_step over them) between its looks at the queue, so neither a reply nor
  // a waiting request waits for a whole settle. A settle that fails closes that session (logged;
  // the next request naming it fails once with FAILED_PRECONDITION: LostSessions).
  bool IdleSettlePending() const;
  void SettleIdle();
  // Most tokens one Step may feed (the runner's chunk).
  int64_t max_step_tokens() const { return options_.prefill_chunk; }
  bool SessionBusy(const std::string& session_id) const { return sessions_->busy(session_id); }
  // Whether one-shot `request` should wait before Begin: a running request of its prefix cache
  // scope is still prefilling a prompt that shares at least a block more with this one's than
  // anything there is to reuse now. Once that prompt is in, this one forks it instead of
  // prefilling the same document beside it (several readers of one document arriving at once).
  // False for requests whose ids are not known yet (Begin tokenizes them) and invalid ones.
  bool PrefillWorthWaitingFor(const GenerateRequest& request) const;

  absl::StatusOr<EvaluateResult> Evaluate(const EvaluateRequest& request);
  // tokenizer.h EncodePrompt: special tokens written in `text` become their ids; BOS is
  // prepended (add_bos) unless the text already starts with it.
  absl::StatusOr<std::vector<int32_t>> Tokenize(const std::string& text, bool add_bos) const;
  std::string Detokenize(const std::vector<int32_t>& ids) const;
  // Frees a kept session's device window and CPU node shards; a lost one (LostSessions) is
  // forgotten. NOT_FOUND if unknown.
  absl::Status CloseSession(const std::string& session_id);
  // Kept sessions and running requests' (the prefix cache's sessions are not counted).
  size_t open_sessions() const { return sessions_->size() - kv_cache_->cached_sessions(); }
  // The prefix cache: the sessions kept for reuse, where they are, and what it evicted.
  const KvCacheManager& kv_cache() const { return *kv_cache_; }
  // Device bytes of every open session's window and page summaries (running requests and kept
  // sessions between turns): what the --kv_cache_bytes admission check counts.
  size_t DeviceKvBytes() const { return sessions_->DeviceBytes(); }

  ModelInfo info() const;
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const Model& model() const { return *model_; }
  Backend& backend() { return *backend_; }
  NodePool& nodes() { return *nodes_; }
  const ModelRunner& runner() const { return *runner_; }
  const EngineOptions& options() const { return options_; }

 private:
  Engine() = default;
  // The page summaries of `seq`'s tier (selection = pages), null otherwise.
  static PageIndex* PagesOf(const Sequence& seq) {
    return seq.offload != nullptr ? seq.offload->page_index() : nullptr;
  }
  // expected_offloaded: entries per (layer, kv head) the CPU nodes should have room for.
  struct SequenceSpec {
    AttentionMode mode = AttentionMode::kHybrid;
    float beta = 1.0f;
    int64_t window = 0;
    int64_t sink = 0;
    SelectionRule selection = SelectionRule::kMaw;
    PagePolicy page_policy;
  };
  // planned_positions: positions the sequence reaches by the end of its first request (sizes
  // a gpu-mode window); expected_offloaded: entries per (layer, kv head) the CPU nodes should
  // have room for.
  absl::StatusOr<std::unique_ptr<Sequence>> NewSequence(const std::string& id,
                                                        const SequenceSpec& spec,
                                                        int64_t planned_positions,
                                                        int64_t expected_offloaded);
  WindowGeometry window_geometry() const;
  WindowOptions WindowOptionsFor(const SequenceSpec& spec, int64_t planned_positions) const;
  // Closes kept session `id` after a failure of its own (not the client's doing), remembering
  // `reason` for the next request that names it (out of the prefix cache too).
  void CloseLostSession(const std::string& id, const std::string& reason);
  // A slice of at most `budget` tokens over the idle settling sessions; returns what is left.
  int64_t SettleIdleSessions(int64_t budget);
  // RESOURCE_EXHAUSTED (saying what to change) when `more` bytes would pass kv_cache_bytes.
  absl::Status CheckDeviceKv(size_t more) const;
  // Device prefill (EngineOptions::device_prefill): widens `seq`'s window for `prompt_tokens`
  // more tokens, as far as the free part of kv_cache_bytes and the device allow (none: the
  // window keeps its size), and sets its prefill_end. Never fails the request.
  // When only part of the prompt fits, a new hybrid session's tier is wrapped in a
  // PrefillSpillTier (prefill_spill_tier.h) so that the chunks attend over the part that left
  // from pinned host pages on the device; EndPrefillSpill unwraps it once the prompt is in.
  void WidenForPrefill(Sequence& seq, int64_t prompt_tokens);
  // A continued turn `g` that ends before any of its feed entered the model: gives the session
  // back its pending token and undoes the prompt's widening, so it is as the last turn left it.
  absl::Status RestoreUntouchedSession(Generation& g);
  // INVALID_ARGUMENT when page_tokens does not divide block_tokens (pages start at blocks).
  absl::Status CheckPagesUsable() const;
  // INVALID_ARGUMENT for a budget policy out of range.
  absl::Status ValidatePagePolicy(const PagePolicy& policy) const;
  // Device bytes of every open session's page summaries.
  size_t PageSummaryBytes() const;
  // RESOURCE_EXHAUSTED (saying what to change) when page summaries of `need` bytes for
  // `expected_offloaded` entries, beside `others` bytes of other sessions', pass the
  // page_summary_bytes cap.
  absl::Status CheckPageSummaries(int64_t expected_offloaded, size_t need, size_t others) const;
  // Grows `seq`'s page summaries to `expected_offloaded` entries per (layer, kv head) within
  // the page_summary_bytes cap; RESOURCE_EXHAUSTED (saying what to change) otherwise.
  absl::Status ReservePages(Sequence& seq, int64_t expected_offloaded) const;
  absl::Status ValidateIds(const std::vector<int32_t>& ids) const;
  // The sequence settings of `request` (its fields, else the engine's defaults), checked.
  absl::StatusOr<SequenceSpec> SpecFor(const GenerateRequest& request) const;
  // The prefix cache's scope keys of a request: its salt and the settings a continued session
  // keeps (mode; window, sink and selection off gpu mode), with `cache` its principal unless
  // the engine shares one scope (cached and running one-shot sessions match it) and `own`
  // always its principal (kept sessions match it: a conversation is never shared).
  struct CacheScope {
    std::string cache;
    std::string own;
  };
  CacheScope PrefixCacheScope(const GenerateRequest& request, const SequenceSpec& spec) const;
  // The session a one-shot request continues from the prefix cache: the cached session of
  // scope.cache sharing the longest prefix with `prompt` (at least prefix_cache_min_tokens ids; its length
  // in *common), or a session in use of that scope whose fed tokens share more (InUsePrefix:
  // always forked). When continuing a cached session in place would drop a block or
  // more of its own tokens (another question over the same document), the request gets a fork
  // of it (ForkSession, sized for `planned` positions; *forked) and it stays cached for the next
  // reader; otherwise, or when no fork can be made, it is taken out of the cache and truncated
  // to the prefix. nullptr on a miss (a session that cannot be truncated that far stays cached).
  Sequence* ReuseCachedPrefix(const CacheScope& scope, const std::vector<int32_t>& prompt,
                              int64_t planned, int64_t* common, bool* forked);
  // The session in use whose fed tokens share the longest prefix (at least
  // prefix_cache_min_tokens, at most prompt.size() - 1) with `prompt`, if any: a running
  // one-shot request's of scope.cache, or a kept session's of scope.own (a pinned prefix).
  // Passed over: sessions whose window is widened for a prefill (not forkable yet), whose tier
  // cannot fork, or whose generation failed in this iteration.
  std::optional<PrefixCache::Hit> InUsePrefix(const CacheScope& scope,
                                              const std::vector<int32_t>& prompt) const;
  // A new session continuing the first `common` tokens of session `parent_id` (cached, of scope
  // `key`, or running), with room for `planned` positions: Sequence::Fork (CPU nodes share the
  // blocks; the device window and page summaries are copied), after the room it needs is made
  // by evicting cached sessions other than the parent. A parent still settling its prompt into
  // its tier settles it first (once, so that its forks share those entries on the CPU nodes). A
  // cached parent stays cached, as the most recently used.
  absl::StatusOr<Sequence*> ForkSession(const std::string& key, const std::string& parent_id,
                                        int64_t common, int64_t planned);
  EngineOptions options_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  size_t max_token_bytes_ = 1;   // MaxTokenBytes(*tokenizer_): bounds prompt text before tokenizing
  ChatConfig chat_;
  std::vector<int32_t> eos_sorted_;   // tokenizer_->eos_ids(), ascending (ModelInfo)
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<DeviceModel> device_model_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<NodePool> nodes_;
  // `exact` mode's path rates: probed at the first exact session, corrected by its tiers.
  std::unique_ptr<ExactRateBook> exact_rates_;
  // The open sessions; the prefix cache over them (cleared in ~Engine before it goes: parked
  // sessions hold its host pages); what becomes of each step's logits rows.
  std::unique_ptr<SessionTable> sessions_;
  std::unique_ptr<KvCacheManager> kv_cache_;
  std::unique_ptr<TokenOutput> token_output_;
  DType kv_dtype_ = DType::kF32;
  int64_t max_context_ = 0;
  std::string id_prefix_;
  // When the last Step returned (its slow-step log names the time between steps too).
  std::chrono::steady_clock::time_point last_step_end_{};
};

}  // namespace tandem::gpu_worker
