// tandem-gpu-worker: loads a model and serves tandem.v1.Generation (plus health, reflection,
// channelz) over gRPC until SIGINT or SIGTERM, then drains calls in flight and exits.
//
// Exit status: 0 after a signal-driven shutdown, 1 when the server cannot start (bad model,
// unreachable CPU nodes, address in use), 2 for a bad command line.
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "log_flags.h"
#include "parse_flags.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"
#include "stop_signals.h"
#include "tandem/common/byte_size.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_isa/cpu_isa.h"
#include "tandem/gpu_worker/memory_plan.h"
#include "tandem/gpu_worker/model_geometry.h"
#include "tandem/gpu_worker/worker_server.h"
#include "tandem/kv_store/kv_store.h"
#include "tandem/security/credentials.h"
#include "tandem/security/token_file.h"

ABSL_FLAG(std::string, model, "", "model directory (config.json, *.safetensors, tokenizer)");
ABSL_FLAG(bool, random_weights, false,
          "serve the model directory's config.json geometry with synthetic weights made on the "
          "device (benchmarks; no weights file is read)");
ABSL_FLAG(std::string, quantization, "",
          "fp8: quantize a bf16 or f32 checkpoint's projections (q/k/v/o, gate/up/down) to FP8 "
          "e4m3 with one scale per output row as they are loaded, about half the weights' "
          "memory; kept FP8 on the cuda backend with bf16 tables, dequantized again elsewhere. "
          "An FP8 checkpoint is FP8 already. none or \"\": the checkpoint as it is");
ABSL_FLAG(std::string, address, "127.0.0.1:50051",
          "host:port to serve on (port 0: any free); 0.0.0.0:50051 serves every interface");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain of this worker (with --tls_key: TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA of client certificates: with it every client must present a certificate "
          "signed by it (mutual TLS); its identity is the client's principal unless a token "
          "names one");
ABSL_FLAG(std::string, auth_token_file, "",
          "file of bearer tokens clients must send ('authorization: Bearer <token>'), one per "
          "line, optionally 'token principal'; needs TLS. Health checks stay open");
ABSL_FLAG(uint32_t, max_sessions_per_principal, 0,
          "kept sessions one client principal may hold; 0 = only --max_sessions bounds them");
ABSL_FLAG(std::string, node_tls_cert, "",
          "PEM certificate of this worker towards the CPU nodes (their --allowed_peers names "
          "its identity)");
ABSL_FLAG(std::string, node_tls_key, "", "PEM private key of --node_tls_cert");
ABSL_FLAG(std::string, node_tls_ca, "",
          "PEM CA the CPU nodes' certificates are verified against (any --node_tls_* flag "
          "makes the node channels TLS)");
ABSL_FLAG(std::string, node_tls_server_name, "",
          "name the CPU nodes' certificates must carry, when nodes are dialled by IP "
          "(--cpu_nodes_dns); \"\" = the host of each address");
ABSL_FLAG(std::string, metrics_address, "",
          "host:port serving Prometheus GET /metrics (e.g. 0.0.0.0:9400; port 0: any free); "
          "\"\" = off");
ABSL_FLAG(std::string, backend, "auto", "auto (cuda when a GPU is usable), cpu or cuda");
ABSL_FLAG(int, cuda_device, 0, "CUDA device ordinal");
ABSL_FLAG(unsigned, cpu_threads, 0, "cpu backend threads; 0 = every core this process may use");
ABSL_FLAG(int64_t, prefill_chunk, 512, "prompt tokens per forward chunk");
ABSL_FLAG(std::string, prefill_attention, "fast",
          "cuda prefill attention kernel over bf16 KV: fast (bf16 q and softmax weights; outputs "
          "within ~1.5e-3 of f64, top-20 log-probs of gutenberg-14m move by <= 1.8e-2) or exact "
          "(f32-accurate, ~1e-6 of f64; about 2.3x the prefill attention time). The cpu backend "
          "has one f32-accurate kernel and ignores it");
ABSL_FLAG(int64_t, max_context, 0,
          "most positions of a session (all turns); 0 = the model's context: "
          "max_position_embeddings, extended by a yarn/dynamic/linear rope scaling, capped at a "
          "sliding window");
ABSL_FLAG(std::string, kv_dtype, "auto", "KV dtype: auto (the weights' kind), bf16 or f32");
ABSL_FLAG(int64_t, block_tokens, 16, "tokens per evicted KV block");
ABSL_FLAG(uint32_t, max_sessions, 64,
          "sessions (kept, one-shot and prefix-cached) held at most; cached ones are evicted "
          "first");
ABSL_FLAG(bool, prefix_cache, true,
          "automatic prefix caching: a one-shot request's KV stays cached when it ends (LRU, "
          "evicted under memory pressure) and a later request of the same scope whose prompt "
          "starts with the same tokens prefills only the rest (usage.cached_tokens)");
ABSL_FLAG(int64_t, prefix_cache_min_tokens, 16,
          "fewest leading tokens a prompt must share with a cached one to reuse it");
ABSL_FLAG(std::string, prefix_cache_scope, "principal",
          "who shares cached prefixes: 'principal' (each caller's token or certificate, plus "
          "the request's cache_salt) or 'shared' (every caller; cache_salt still separates). "
          "A cache hit is faster, so a caller can tell from timing whether a prompt was cached "
          "in its scope");
ABSL_FLAG(std::string, prefix_cache_host_bytes, "auto",
          "host memory (pinned) for cached sessions parked off the GPU when it needs their "
          "room; a prompt that hits a parked session brings it back over PCIe instead of "
          "prefilling it again. A byte size (0 = close them instead) or 'auto': a quarter of "
          "the host's physical memory on the cuda backend, 0 on the cpu backend");
ABSL_FLAG(int64_t, max_batch, 64,
          "requests decoded together in one step (continuous batching); <= step_tokens");
ABSL_FLAG(int64_t, step_tokens, 0,
          "tokens one step feeds (decode tokens + prefill chunks); 0 = prefill_chunk");
ABSL_FLAG(double, max_step_ms, 0,
          "cap each step's prompt tokens so that a step takes about this long (recent steps' "
          "times as a fixed part, from decode steps, plus seconds per prompt token, which grow "
          "with a long prompt's prefix): a request arriving during a long prefill waits for "
          "about one such step, decoding requests keep their inter-token latency; the long "
          "prompt takes more, smaller steps, each paying the fixed part. 0 = steps of "
          "step_tokens");
ABSL_FLAG(bool, prefill_breaks, true,
          "a step that feeds a prompt chunk lets requests that arrive while it runs start "
          "between its layers: their prompts (those that finish in one step) and the decode "
          "rows of requests the step does not carry run in an interlude, then the chunk goes "
          "on, so a short prompt waits for about one layer of a long chunk instead of all of "
          "it. Costs prefill_chunk x hidden floats of device memory and one host wait for the "
          "device per layer of such steps; steps whose attention uses CPU nodes or host pages "
          "take no breaks");
ABSL_FLAG(double, max_decode_gap_ms, 0,
          "with --prefill_breaks: decoding requests are not carried by steps that feed prompt "
          "tokens; an interlude gives them their next token once the oldest has waited this "
          "long (their inter-token latency during long prefills is about this plus a decode "
          "step; each interlude costs the long prompt about a decode step). 0 = they ride "
          "along the prefill steps (no extra cost, but each token waits for a whole chunk)");
ABSL_FLAG(tandem::ByteSize, kv_cache_bytes, tandem::ByteSize{0},
          "device bytes all sessions' KV (windows, gpu-mode KV, page summaries) may take; a "
          "request that does not fit waits for others to end; 0 = the device's memory");
ABSL_FLAG(bool, device_prefill, true,
          "hybrid/offload prompts: keep the prompt's KV on the device while it is prefilled (a "
          "widened window, within --kv_cache_bytes) so every chunk attends over it on the GPU; "
          "the blocks beyond the window go to the CPU nodes / host pages after the first token. "
          "false: each chunk attends over the evicted part through the tier");
ABSL_FLAG(int64_t, settle_tokens_per_step, 1024,
          "after a device prefill: most tokens of prompts' blocks beyond the window that move to "
          "the CPU nodes / host pages per step, over all sessions (the request decodes on, its "
          "window attending over the rest); bounds what a settle adds to any step; 0 = a whole "
          "prompt in the step after its first token");
ABSL_FLAG(bool, settle_shares_prefill_budget, true,
          "a step that feeds prompt chunks settles only what they leave of "
          "--settle_tokens_per_step (at least one block), so a chunk and a settle slice do not "
          "stall decoding requests together");
ABSL_FLAG(int64_t, max_waiting, 4096, "requests queued beyond the running ones; more: refused");
ABSL_FLAG(std::string, mode, "hybrid",
          "default attention mode of requests: gpu (all KV on the device), hybrid (window on the "
          "device, the rest on CPU nodes), offload (window on the device, the rest in pinned "
          "host memory streamed over PCIe every step: exact) or exact (window on the device, the "
          "rest split by a planner between host pages streamed over PCIe and CPU nodes attending "
          "densely: exact)");
ABSL_FLAG(double, exact_fetch_share, -1,
          "mode=exact: force this share (0..1) of the offloaded entries into host pages streamed "
          "over PCIe, the rest on the CPU nodes; < 0 = the planned split (measured rates)");
ABSL_FLAG(std::string, exact_recompute, "auto",
          "mode=exact: 'auto' lets the planner recompute part of the offloaded K/V on the device "
          "from stored layer inputs (KVPR) where its verdict says it pays (MHA models); 'off' "
          "never does");
ABSL_FLAG(double, beta, 1.0, "default hybrid selection threshold (>= 0; 0 = exact)");
ABSL_FLAG(int64_t, window, 1024, "default hybrid device window, tokens");
ABSL_FLAG(int64_t, sink, 4, "default hybrid attention-sink tokens kept on the device");
ABSL_FLAG(std::string, selection, "pages",
          "default hybrid selection: pages (query-aware pages within --select_tokens) or maw "
          "(HGCA, by --beta); a request that sets beta but no selection gets maw");
ABSL_FLAG(int64_t, select_tokens, 512,
          "selection=pages: default offloaded entries attended per (layer, kv head, token)");
ABSL_FLAG(int64_t, dense_layers, 0,
          "selection=pages: default count of first layers that attend over every entry");
ABSL_FLAG(double, page_centroid_share, 0.5,
          "selection=pages: default share of each budget chosen by q·mean after the rest by "
          "Quest's bound, in [0, 1] (0 = the bound alone)");
ABSL_FLAG(bool, page_speculate, true,
          "selection=pages: choose each layer's pages from a guess of its queries made from the "
          "layer before, while the CPU nodes attend the previous layer (off the serial path); "
          "false: from the true queries");
ABSL_FLAG(int64_t, page_key_rank, -1,
          "selection=pages: coordinates kept per offloaded key for the low-rank page score "
          "(-1 = head_dim / 2, 0 = none: the second score is q·mean)");
ABSL_FLAG(int64_t, page_key_calib_tokens, 4096,
          "selection=pages: offloaded keys per (layer, kv head) whose K^T K gives the low-rank "
          "basis");
ABSL_FLAG(int64_t, page_tokens, 16,
          "selection=pages: entries per summarised page (must divide --block_tokens)");
ABSL_FLAG(tandem::ByteSize, page_summary_bytes, tandem::ByteSize{0},
          "device bytes all sessions' page summaries may use (0 = no cap but the device)");
ABSL_FLAG(double, maw_alpha, 0.1, "moving-average rate of the attention weights (0, 1]");
ABSL_FLAG(std::vector<std::string>, cpu_nodes, {},
          "CPU attention nodes, comma-separated host:port; empty (and no --cpu_nodes_dns) = "
          "one node embedded in this process");
ABSL_FLAG(std::string, transport, "auto",
          "Attend/AppendKv transport to CPU nodes: auto (shared memory for nodes on this host, "
          "else gRPC), shm (fail unless every node takes shared memory) or grpc");
ABSL_FLAG(std::string, cpu_nodes_dns, "",
          "name:port resolving to every CPU attention node (a headless Service)");
ABSL_FLAG(double, cpu_nodes_refresh_s, 10.0,
          "seconds between re-reading the CPU node list / re-resolving --cpu_nodes_dns and "
          "polling every node's Stats (joins, drains); 0 = never");
ABSL_FLAG(std::string, placement, "balanced",
          "placement of a session's (layer, kv head) shards on the CPU nodes: balanced (cost "
          "model, re-planned live with shard migration) or uniform (round-robin)");
ABSL_FLAG(int, replan_every_steps, 16, "decode steps between placement re-plans (0 = never)");
ABSL_FLAG(double, replan_min_gain, 0.05,
          "modelled step-time gain (fraction) that justifies migrating shards");
ABSL_FLAG(int, attend_deadline_ms, 2000,
          "deadline of each Attend call to a CPU node; a node that misses it is out of "
          "placement until it answers again, its shards rebuilt on the others");
ABSL_FLAG(int, control_deadline_ms, 30000,
          "deadline of a CPU node's OpenSession, AppendKv, Reselect and CloseSession calls");
ABSL_FLAG(int, cpu_nodes_probe_ms, 250,
          "period of the health probe (Stats) of CPU nodes that failed a call; they rejoin "
          "placement once they answer; 0 = only at --cpu_nodes_refresh_s");
ABSL_FLAG(uint32_t, node_shm_fill_threads, 4,
          "threads (the scheduler's included) that copy evicted KV into shared-memory appends "
          "to CPU nodes on this host; 1..64");
ABSL_FLAG(std::string, worker_name, "",
          "this worker's name on the CPU nodes, the same across its restarts and unique among "
          "workers (1..128 of [A-Za-z0-9._:-]): its sessions there are leased to it, and a "
          "restarted worker frees what its previous process held; \"\" = host:port of "
          "--address");
ABSL_FLAG(double, node_lease_s, 10.0,
          "lease period of this worker's sessions on remote CPU nodes, renewed every third of "
          "it: the nodes close them 2 periods after the worker is gone; 0 = no lease (they stay "
          "until closed)");
ABSL_FLAG(tandem::ByteSize, embedded_pool_bytes, tandem::ByteSize{4ull << 30},
          "KV memory of the embedded CPU node, e.g. 16GiB");
ABSL_FLAG(tandem::ByteSize, node_warm_reserve, tandem::ByteSize{512ull << 20},
          "free KV block memory the embedded CPU node keeps faulted in while sessions hold "
          "blocks, so settle appends copy at memory speed; 0 = none");
ABSL_FLAG(bool, node_huge_pages, true,
          "back the embedded CPU node's KV blocks with transparent huge pages (a fault per 2 MiB "
          "instead of per 4 KiB when appends reach fresh memory; the node's --huge_pages)");
ABSL_FLAG(std::string, node_kv_dtype, "bf16",
          "how the embedded CPU node stores KV: bf16 (as sent) or int8 (8-bit, about half the "
          "memory; see tandem-cpu-attention --node_kv_dtype)");
ABSL_FLAG(tandem::ByteSize, max_message_bytes, tandem::ByteSize{64ull << 20},
          "largest gRPC message accepted or sent");
ABSL_FLAG(int, shutdown_grace_ms, 5000, "time calls in flight get to finish on shutdown");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error");
ABSL_FLAG(bool, plan, false,
          "print the memory plan (device, host, CPU nodes) of --plan_context tokens x "
          "--plan_batch sequences in --plan_mode for this model and these options, without "
          "loading weights, and exit: 0 if it fits, 1 if not");
ABSL_FLAG(int64_t, plan_context, 0, "--plan: positions per sequence; 0 = the context limit");
ABSL_FLAG(int64_t, plan_prompt, 0, "--plan: prompt tokens of them; 0 = all");
ABSL_FLAG(int64_t, plan_batch, 1, "--plan: sequences held at once");
ABSL_FLAG(std::string, plan_mode, "", "--plan: gpu, hybrid, offload or exact; \"\" = --mode");
ABSL_FLAG(bool, plan_json, false, "--plan: print JSON instead of the table");
ABSL_FLAG(tandem::ByteSize, plan_device_bytes, tandem::ByteSize{0},
          "--plan: device memory to plan for; 0 = the device's (or the host's, cpu backend)");
ABSL_FLAG(std::vector<std::string>, plan_node_bytes, {},
          "--plan: pools of planned CPU nodes instead of asking --cpu_nodes, e.g. 64GiB,64GiB");
ABSL_FLAG(std::string, preset, "",
          "--plan: a geometry preset (tandem-geometry: llama3-8b, tiny) instead of --model");
ABSL_FLAG(std::string, preset_set, "", "--plan: key=value overrides of --preset");

namespace {

absl::Status UsageError(absl::string_view message) { return absl::InvalidArgumentError(message); }

// TLS, tokens and the per-principal bound of the port; the credentials of the node channels.
absl::Status SecurityFromFlags(tandem::gpu_worker::WorkerServerOptions* options) {
  options->tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                  absl::GetFlag(FLAGS_tls_ca)};
  if (const std::string path = absl::GetFlag(FLAGS_auth_token_file); !path.empty()) {
    TANDEM_ASSIGN_OR_RETURN(tandem::security::TokenTable tokens,
                            tandem::security::TokenTable::Load(path));
    options->tokens = std::move(tokens);
  }
  options->max_sessions_per_principal = absl::GetFlag(FLAGS_max_sessions_per_principal);
  const tandem::security::TlsFiles node_tls = {absl::GetFlag(FLAGS_node_tls_cert),
                                               absl::GetFlag(FLAGS_node_tls_key),
                                               absl::GetFlag(FLAGS_node_tls_ca)};
  if (node_tls.enabled()) {
    TANDEM_ASSIGN_OR_RETURN(
        options->engine.nodes.credentials,
        tandem::security::ChannelCredentialsFromFiles(node_tls, "", "--node_tls_"));
  }
  options->engine.nodes.tls_server_name = absl::GetFlag(FLAGS_node_tls_server_name);
  return absl::OkStatus();
}

// --worker_name and --node_lease_s: the lease of this worker's sessions on remote CPU nodes.
absl::Status NodeLeaseFromFlags(tandem::gpu_worker::NodePoolOptions* nodes,
                                const std::string& address) {
  const double lease_s = absl::GetFlag(FLAGS_node_lease_s);
  if (!(lease_s == 0 || (lease_s >= 0.1 && lease_s <= 3600))) {
    return UsageError("--node_lease_s must be 0 or in 0.1..3600");
  }
  nodes->lease_period_ms = static_cast<int>(std::lround(lease_s * 1000));
  nodes->lease_holder = absl::GetFlag(FLAGS_worker_name);
  if (nodes->lease_holder.empty()) {
    // host:port, with any character a name may not hold made '-'.
    char host[256] = {};
    if (gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "worker");
    const size_t colon = address.rfind(':');
    nodes->lease_holder =
        absl::StrCat(host, ":", colon == std::string::npos ? "0" : address.substr(colon + 1));
    for (char& c : nodes->lease_holder) {
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != ':' &&
          c != '-') {
        c = '-';
      }
    }
    if (nodes->lease_holder.size() > 128) nodes->lease_holder.resize(128);
  }
  return tandem::kv_store::ValidateName("--worker_name", nodes->lease_holder);
}

absl::StatusOr<tandem::gpu_worker::WorkerServerOptions> OptionsFromFlags() {
  tandem::gpu_worker::WorkerServerOptions options;
  options.address = absl::GetFlag(FLAGS_address);
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  TANDEM_RETURN_IF_ERROR(SecurityFromFlags(&options));
  tandem::gpu_worker::EngineOptions& e = options.engine;
  e.model_dir = absl::GetFlag(FLAGS_model);
  const bool preset_plan = absl::GetFlag(FLAGS_plan) && !absl::GetFlag(FLAGS_preset).empty();
  if (e.model_dir.empty() && !preset_plan) {
    return UsageError("--model is required (or --plan --preset=NAME)");
  }
  e.backend = absl::GetFlag(FLAGS_backend);
  if (e.backend != "auto" && e.backend != "cpu" && e.backend != "cuda") {
    return UsageError(absl::StrCat("--backend must be auto, cpu or cuda, got '", e.backend, "'"));
  }
  e.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  e.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  e.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  absl::StatusOr<tandem::gpu_worker::PrefillAttention> prefill_attention =
      tandem::gpu_worker::ParsePrefillAttention(absl::GetFlag(FLAGS_prefill_attention));
  if (!prefill_attention.ok()) {
    return UsageError(absl::StrCat("--", prefill_attention.status().message()));
  }
  e.backend_options.prefill_attention = *prefill_attention;
  e.max_context = absl::GetFlag(FLAGS_max_context);
  if (e.max_context < 0) return UsageError("--max_context must be >= 0");
  e.kv_dtype = absl::GetFlag(FLAGS_kv_dtype);
  e.block_tokens = absl::GetFlag(FLAGS_block_tokens);
  e.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  e.prefix_cache = absl::GetFlag(FLAGS_prefix_cache);
  e.prefix_cache_min_tokens = absl::GetFlag(FLAGS_prefix_cache_min_tokens);
  const std::string scope = absl::GetFlag(FLAGS_prefix_cache_scope);
  if (scope != "principal" && scope != "shared") {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefix_cache_scope must be 'principal' or 'shared', got '", scope, "'"));
  }
  e.prefix_cache_shared_scope = scope == "shared";
  if (const std::string host = absl::GetFlag(FLAGS_prefix_cache_host_bytes); host != "auto") {
    uint64_t bytes = 0;
    std::string error;
    if (!tandem::ParseByteSize(host, &bytes, &error)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--prefix_cache_host_bytes: ", error, ", or 'auto'"));
    }
    e.prefix_cache_host_bytes = bytes;
  }
  if (e.prefix_cache_min_tokens < 1) {
    return absl::InvalidArgumentError("--prefix_cache_min_tokens must be >= 1");
  }
  e.random_weights = absl::GetFlag(FLAGS_random_weights);
  e.quantization = absl::GetFlag(FLAGS_quantization);
  tandem::gpu_worker::ModelConfig scratch;  // checks the value before any model is read
  if (const absl::Status s = tandem::gpu_worker::ApplyQuantizationOption(e.quantization, &scratch);
      !s.ok()) {
    return UsageError(s.message());
  }
  e.kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_bytes).bytes;
  e.device_prefill = absl::GetFlag(FLAGS_device_prefill);
  e.settle_tokens_per_step = absl::GetFlag(FLAGS_settle_tokens_per_step);
  e.settle_shares_prefill_budget = absl::GetFlag(FLAGS_settle_shares_prefill_budget);
  e.prefill_breaks = absl::GetFlag(FLAGS_prefill_breaks);
  options.scheduler.max_batch = absl::GetFlag(FLAGS_max_batch);
  options.scheduler.step_tokens = absl::GetFlag(FLAGS_step_tokens);
  options.scheduler.max_step_ms = absl::GetFlag(FLAGS_max_step_ms);
  options.scheduler.max_decode_gap_ms = absl::GetFlag(FLAGS_max_decode_gap_ms);
  options.scheduler.max_waiting = absl::GetFlag(FLAGS_max_waiting);
  absl::StatusOr<tandem::gpu_worker::AttentionMode> mode =
      tandem::gpu_worker::ParseAttentionMode(absl::GetFlag(FLAGS_mode));
  if (!mode.ok()) return UsageError(absl::StrCat("--mode: ", mode.status().message()));
  e.default_mode = *mode;
  const double beta = absl::GetFlag(FLAGS_beta);
  if (!std::isfinite(beta) || beta < 0) return UsageError("--beta must be finite and >= 0");
  e.default_beta = static_cast<float>(beta);
  e.default_window = absl::GetFlag(FLAGS_window);
  e.default_sink = absl::GetFlag(FLAGS_sink);
  if (e.default_window < 1 || e.default_sink < 0) {
    return UsageError("--window must be >= 1 and --sink >= 0");
  }
  absl::StatusOr<tandem::gpu_worker::SelectionRule> selection =
      tandem::gpu_worker::ParseSelectionRule(absl::GetFlag(FLAGS_selection));
  if (!selection.ok()) {
    return UsageError(absl::StrCat("--selection: ", selection.status().message()));
  }
  e.default_selection = *selection;
  e.default_page_policy.select_tokens = absl::GetFlag(FLAGS_select_tokens);
  e.default_page_policy.dense_layers = absl::GetFlag(FLAGS_dense_layers);
  e.default_page_policy.centroid_share = absl::GetFlag(FLAGS_page_centroid_share);
  if (e.default_page_policy.select_tokens < 1 || e.default_page_policy.dense_layers < 0) {
    return UsageError("--select_tokens must be >= 1 and --dense_layers >= 0");
  }
  if (!(e.default_page_policy.centroid_share >= 0.0 &&
        e.default_page_policy.centroid_share <= 1.0)) {
    return UsageError("--page_centroid_share must be in [0, 1]");
  }
  e.page_tokens = absl::GetFlag(FLAGS_page_tokens);
  e.page_low_rank = {absl::GetFlag(FLAGS_page_key_rank),
                     absl::GetFlag(FLAGS_page_key_calib_tokens)};
  e.page_speculate = absl::GetFlag(FLAGS_page_speculate);
  if (e.page_tokens < 1 || e.page_tokens > 4096) {
    return UsageError("--page_tokens must be in 1..4096");
  }
  if (e.default_selection == tandem::gpu_worker::SelectionRule::kPages &&
      e.block_tokens % e.page_tokens != 0) {
    return UsageError("--selection=pages needs --page_tokens to divide --block_tokens");
  }
  e.page_summary_bytes = absl::GetFlag(FLAGS_page_summary_bytes).bytes;
  const double alpha = absl::GetFlag(FLAGS_maw_alpha);
  if (!(alpha > 0 && alpha <= 1)) return UsageError("--maw_alpha must be in (0, 1]");
  e.maw_alpha = static_cast<float>(alpha);
  for (const std::string& node : absl::GetFlag(FLAGS_cpu_nodes)) {
    if (!node.empty()) e.nodes.addresses.push_back(node);
  }
  e.nodes.dns_name = absl::GetFlag(FLAGS_cpu_nodes_dns);
  absl::StatusOr<tandem::gpu_worker::NodeTransport> transport =
      tandem::gpu_worker::ParseNodeTransport(absl::GetFlag(FLAGS_transport));
  if (!transport.ok()) {
    return UsageError(absl::StrCat("--transport: ", transport.status().message()));
  }
  e.nodes.transport = *transport;
  if (!e.nodes.addresses.empty() && !e.nodes.dns_name.empty()) {
    return UsageError("give --cpu_nodes or --cpu_nodes_dns, not both");
  }
  const double refresh_s = absl::GetFlag(FLAGS_cpu_nodes_refresh_s);
  if (!(refresh_s >= 0 && refresh_s <= 86400)) {
    return UsageError("--cpu_nodes_refresh_s must be in 0..86400");
  }
  e.nodes.refresh_ms = static_cast<int>(refresh_s * 1000);
  absl::StatusOr<tandem::gpu_worker::PlacementPolicy> placement =
      tandem::gpu_worker::ParsePlacementPolicy(absl::GetFlag(FLAGS_placement));
  if (!placement.ok()) {
    return UsageError(absl::StrCat("--placement: ", placement.status().message()));
  }
  e.placement = *placement;
  e.replan_every_steps = absl::GetFlag(FLAGS_replan_every_steps);
  e.replan_min_gain = absl::GetFlag(FLAGS_replan_min_gain);
  e.exact_fetch_share = absl::GetFlag(FLAGS_exact_fetch_share);
  if (!(e.exact_fetch_share <= 1)) return UsageError("--exact_fetch_share must be <= 1");
  const std::string exact_recompute = absl::GetFlag(FLAGS_exact_recompute);
  if (exact_recompute != "auto" && exact_recompute != "off") {
    return UsageError("--exact_recompute must be auto or off");
  }
  e.exact_recompute = exact_recompute == "auto";
  if (e.replan_every_steps < 0 || !(e.replan_min_gain >= 0 && e.replan_min_gain <= 1)) {
    return UsageError("--replan_every_steps must be >= 0 and --replan_min_gain in [0, 1]");
  }
  e.nodes.embedded.pool_bytes = absl::GetFlag(FLAGS_embedded_pool_bytes).bytes;
  e.nodes.embedded.warm_reserve_bytes = absl::GetFlag(FLAGS_node_warm_reserve).bytes;
  e.nodes.embedded.huge_pages = absl::GetFlag(FLAGS_node_huge_pages);
  absl::StatusOr<tandem::kv_store::KvDType> node_kv_dtype =
      tandem::cpu_attention::ParseNodeKvDType(absl::GetFlag(FLAGS_node_kv_dtype));
  if (!node_kv_dtype.ok()) {
    return UsageError(absl::StrCat("--", node_kv_dtype.status().message()));
  }
  e.nodes.embedded.kv_dtype = *node_kv_dtype;
  e.attend_deadline_ms = absl::GetFlag(FLAGS_attend_deadline_ms);
  if (e.attend_deadline_ms < 1) return UsageError("--attend_deadline_ms must be >= 1");
  e.control_deadline_ms = absl::GetFlag(FLAGS_control_deadline_ms);
  if (e.control_deadline_ms < 1) return UsageError("--control_deadline_ms must be >= 1");
  e.nodes.probe_ms = absl::GetFlag(FLAGS_cpu_nodes_probe_ms);
  if (e.nodes.probe_ms < 0 || e.nodes.probe_ms > 60000) {
    return UsageError("--cpu_nodes_probe_ms must be in 0..60000");
  }
  e.nodes.shm_fill_threads = absl::GetFlag(FLAGS_node_shm_fill_threads);
  if (e.nodes.shm_fill_threads < 1 || e.nodes.shm_fill_threads > 64) {
    return UsageError("--node_shm_fill_threads must be in 1..64");
  }
  TANDEM_RETURN_IF_ERROR(NodeLeaseFromFlags(&e.nodes, options.address));
  const uint64_t max_message = absl::GetFlag(FLAGS_max_message_bytes).bytes;
  if (max_message < (1u << 20) || max_message > (1u << 30)) {
    return UsageError("--max_message_bytes must be in 1MiB..1GiB");
  }
  options.max_message_bytes = static_cast<int>(max_message);
  e.nodes.max_message_bytes = options.max_message_bytes;
  return options;
}

// --plan: the memory plan of these options (memory_plan.h); exit 0 if it fits, 1 if not or on
// an error, 2 for a bad --plan_* value.
int RunPlan(const tandem::gpu_worker::EngineOptions& options) {
  namespace gw = tandem::gpu_worker;
  absl::StatusOr<gw::ModelConfig> preset = absl::NotFoundError("no --preset");
  if (const std::string name = absl::GetFlag(FLAGS_preset); !name.empty()) {
    preset = gw::GeometryPreset(name);
    if (preset.ok()) {
      if (absl::Status s = gw::ApplyGeometryOverrides(absl::GetFlag(FLAGS_preset_set), *preset);
          !s.ok()) {
        preset = s;
      }
    }
    if (!preset.ok()) {
      std::fprintf(stderr, "tandem-gpu-worker: --preset: %s\n",
                   std::string(preset.status().message()).c_str());
      return 2;
    }
  }
  gw::EngineOptions planned = options;
  const std::vector<std::string> node_bytes = absl::GetFlag(FLAGS_plan_node_bytes);
  if (!node_bytes.empty()) {  // planned nodes (set below): nobody to ask
    planned.nodes.addresses.clear();
    planned.nodes.dns_name.clear();
  }
  absl::StatusOr<gw::MemoryPlanSetup> setup =
      gw::PlanSetupFromOptions(planned, preset.ok() ? &*preset : nullptr);
  if (!setup.ok()) {
    std::fprintf(stderr, "tandem-gpu-worker: --plan: %s\n", setup.status().ToString().c_str());
    return 1;
  }
  if (!node_bytes.empty()) {
    setup->nodes.clear();
    setup->embedded_node = false;
    for (size_t i = 0; i < node_bytes.size(); ++i) {
      uint64_t bytes = 0;
      std::string error;
      if (!tandem::ParseByteSize(node_bytes[i], &bytes, &error)) {
        std::fprintf(stderr, "tandem-gpu-worker: --plan_node_bytes: %s\n", error.c_str());
        return 2;
      }
      setup->nodes.push_back({absl::StrCat("planned-", i), bytes, bytes, std::nullopt});
    }
  }
  if (const uint64_t device = absl::GetFlag(FLAGS_plan_device_bytes).bytes; device > 0) {
    setup->device_total_bytes = device;
  }
  gw::MemoryPlanRequest request = gw::MemoryPlanRequest::Defaults(options);
  request.context = absl::GetFlag(FLAGS_plan_context);
  if (request.context == 0) request.context = setup->max_context;
  request.prompt = absl::GetFlag(FLAGS_plan_prompt);
  request.batch = absl::GetFlag(FLAGS_plan_batch);
  if (const std::string mode = absl::GetFlag(FLAGS_plan_mode); !mode.empty()) {
    absl::StatusOr<gw::AttentionMode> parsed = gw::ParseAttentionMode(mode);
    if (!parsed.ok()) {
      std::fprintf(stderr, "tandem-gpu-worker: --plan_mode: %s\n",
                   std::string(parsed.status().message()).c_str());
      return 2;
    }
    request.mode = *parsed;
  }
  absl::StatusOr<gw::MemoryPlan> plan = gw::EstimateMemory(*setup, request);
  absl::StatusOr<int64_t> largest =
      plan.ok() ? gw::LargestFittingContext(*setup, request) : plan.status();
  if (!largest.ok()) {
    std::fprintf(stderr, "tandem-gpu-worker: --plan: %s\n", largest.status().ToString().c_str());
    return absl::IsInvalidArgument(largest.status()) ? 2 : 1;
  }
  plan->largest_context = *largest;
  const std::string text = absl::GetFlag(FLAGS_plan_json) ? gw::MemoryPlanJson(*plan) + "\n"
                                                          : gw::FormatMemoryPlan(*plan);
  std::fputs(text.c_str(), stdout);
  return plan->fits ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Before anything starts a thread (stop_signals.h); the main thread waits for them below.
  const sigset_t stop_signals = tandem::services::BlockStopSignals();
  // --help lists the flags of this file (absl's default looks for a file named like the binary).
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "gpu_worker_main.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "tandem GPU worker: serves tandem.v1.Generation for one model.\n"
      "  tandem-gpu-worker --model=DIR --address=0.0.0.0:50051 --mode=hybrid "
      "--cpu_nodes=node1:50061,node2:50061");
  const std::vector<char*> positional = tandem::services::ParseCommandLineOrExitTwo(argc, argv);
  if (!tandem::services::ConfigureStderrLogging("tandem-gpu-worker",
                                                absl::GetFlag(FLAGS_log_level))) {
    return 2;
  }
  if (positional.size() > 1) {
    std::fprintf(stderr, "tandem-gpu-worker: unexpected argument '%s'\n", positional[1]);
    return 2;
  }
  if (const absl::Status isa = tandem::CheckCpuIsaEnvironment(); !isa.ok()) {
    std::fprintf(stderr, "tandem-gpu-worker: %s\n", std::string(isa.message()).c_str());
    return 2;
  }
  absl::StatusOr<tandem::gpu_worker::WorkerServerOptions> options = OptionsFromFlags();
  if (!options.ok()) {
    std::fprintf(stderr, "tandem-gpu-worker: %s\n",
                 std::string(options.status().message()).c_str());
    return 2;
  }

  if (absl::GetFlag(FLAGS_plan)) return RunPlan(options->engine);

  auto server = tandem::gpu_worker::GpuWorkerServer::Start(*options);
  if (!server.ok()) {
    spdlog::error("cannot start: {}", server.status().ToString());
    return 1;
  }
  const tandem::gpu_worker::ModelInfo& info = (*server)->model_info();
  spdlog::info(
      "tandem-gpu-worker serving {} ({} layers, vocab {}, context {}) on {} [{}], {} "
      "CPU node(s), port {}",
      info.model_dir, info.num_layers, info.vocab_size, info.max_context, info.backend, info.device,
      info.cpu_nodes, (*server)->port());
  const tandem::gpu_worker::EngineOptions& engine_options = options->engine;
  const bool embedded_node =
      absl::GetFlag(FLAGS_cpu_nodes).empty() && absl::GetFlag(FLAGS_cpu_nodes_dns).empty();
  spdlog::info("memory: weights {} ({}), device KV budget {}, embedded CPU node pool {}",
               tandem::FormatBytes(info.weight_bytes), info.weight_dtype,
               engine_options.kv_cache_bytes == 0
                   ? std::string("all free device memory")
                   : tandem::FormatBytes(engine_options.kv_cache_bytes),
               embedded_node ? tandem::FormatBytes(engine_options.nodes.embedded.pool_bytes)
                             : std::string("none (remote nodes)"));
  if ((*server)->metrics_port() != 0) {
    spdlog::info("Prometheus metrics on port {} (GET /metrics)", (*server)->metrics_port());
  }
  // A line scripts can wait for.
  std::printf("LISTENING %d\n", (*server)->port());
  std::fflush(stdout);

  int sig = 0;
  sigwait(&stop_signals, &sig);
  spdlog::info("signal {}: draining", sig);
  (*server)->Shutdown(absl::GetFlag(FLAGS_shutdown_grace_ms));
  (*server)->Wait();
  server->reset();
  spdlog::info("stopped");
  return 0;
}
