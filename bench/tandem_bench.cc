// tandem-bench: decode speed of the three attention modes at long contexts, side by side in one
// run, each figure next to the physical limit of its configuration (issue 4).
//
// Model: a geometry preset (default llama3-8b) with random weights made on the device
// (DeviceModel::CreateRandom). Contexts are synthetic (synthetic_context.h): the KV of `context`
// positions is placed where each mode keeps it, then --steps decode steps are timed (after
// --warmup) with a batch of --batches sequences. Modes:
//   gpu      all KV on the device (skipped when it does not fit)
//   offload  window on the device, the rest in pinned host pages streamed over PCIe every step
//   exact    window on the device, the rest split by the ExactPlanner between host pages
//            streamed over PCIe and the CPU node attending densely (the plan is in the row)
//   hybrid   window on the device, the rest on the CPU node (embedded in this process, over the
//            shared-memory transport by default), attending to --shares of it (MAW), or, for
//            each of --select_tokens, to the pages the device picks within that budget
//            (selection = pages: page summaries on the device, one SelectPages per layer)
// TTFT: a real prefill of --prefill_tokens (or each of --prefill_contexts) random tokens (chunks
// of --prefill_chunk) per mode, on the serving path: with --device_prefill (default) offload and
// hybrid widen their window to hold the prompt (WindowCache::Widen, as far as the device allows
// after --prefill_headroom_mb), so every chunk attends on the device; ttft_s ends at the first
// sampled token; then the sequence decodes while its blocks beyond the window move to the tier
// (host pages / CPU node) a slice of --settle_tokens_per_step per step, as serving does:
// settled_s ends when the last is on the tier, settle_step_max_s is the slowest of those steps. A prompt larger than the widened window (or than --prefill_widen_mb) spills the rest:
// hybrid then attends over it from host pages on the device (PrefillSpillTier), as serving does.
// Hybrid runs once per --prefill_selections (maw: beta --prefill_beta; pages: budget
// --prefill_select_tokens).
//
// Limits (all rates measured at the start of the run, physical_limits.h), per decode step:
//   hbm  = (weights + B · device KV bytes read) / device copy bandwidth
//   cpu  = hybrid: B · selected KV bytes / CPU scan rate
//   pcie = offload: B · offloaded KV bytes / host-to-device bandwidth;
//          hybrid: B · (q + o + lse) bytes per layer / the same bandwidth
//   limit = max(hbm, cpu, pcie); ratio = measured median / limit.
// Hybrid decode is timed for each --micro_batches setting on the same sequences: 1 runs one pass
// over the batch (the GPU and CPU parts of a step add up), 2 lets the runner split the batch
// into ping-pong micro-batches (model_runner.h); the 2 row reports ratio_to_serial, its median
// over the 1 row's (issue 12's target: <= 0.65), and the 1 row's GPU part and CPU wait.
// selection = pages also reports the serial limit of issue 11, limit_sum = selected bytes / CPU
// scan rate + page-summary bytes / HBM rate + the GPU's own step (weights + window / HBM rate).
// Prints one JSON line per configuration (and to --json), then a table.
//
//   tandem-bench --contexts 32768,131072,524288 --batches 1,8 --modes gpu,offload,hybrid
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "parse_flags.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "physical_limits.h"
#include "synthetic_context.h"
#include "tandem/common/byte_size.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/exact_tier.h"
#include "tandem/gpu_worker/model_geometry.h"
#include "tandem/gpu_worker/host_tier.h"
#include "tandem/gpu_worker/model_runner.h"
#include "tandem/gpu_worker/node_pool.h"
#include "tandem/gpu_worker/node_tier.h"
#include "tandem/gpu_worker/page_index.h"
#include "tandem/gpu_worker/prefill_spill_tier.h"
#include "tandem/gpu_worker/tier_factory.h"
#include "tandem/gpu_worker/random_values.h"
#include "tandem/gpu_worker/remote_kv.h"

ABSL_FLAG(std::string, preset, "llama3-8b", "model geometry preset");
ABSL_FLAG(std::string, set, "", "geometry overrides key=value,...");
ABSL_FLAG(std::string, backend, "cuda", "cuda or cpu");
ABSL_FLAG(std::string, prefill_attention, "fast",
          "cuda prefill attention kernel: fast (bf16 q and softmax weights) or exact "
          "(f32-accurate, about 2.3x the prefill attention time); the cpu backend ignores it");
ABSL_FLAG(std::string, contexts, "32768,131072,524288", "context lengths (tokens)");
ABSL_FLAG(std::string, batches, "1,8", "decode batch sizes");
ABSL_FLAG(std::string, modes, "gpu,offload,hybrid", "attention modes");
ABSL_FLAG(std::string, shares, "0.05,0.1,0.3", "hybrid: selected shares of the offloaded KV");
ABSL_FLAG(int64_t, window, 4096, "offload/hybrid: recent tokens on the device");
ABSL_FLAG(int64_t, sink, 4, "offload/hybrid: sink tokens");
ABSL_FLAG(int64_t, block, 64, "tokens per evicted block");
ABSL_FLAG(int64_t, page_tokens, 16384, "offload: tokens per host page (one upload)");
ABSL_FLAG(int, steps, 12, "timed decode steps per configuration");
ABSL_FLAG(std::string, exact_recompute, "off",
          "exact: comma list of off and auto; auto lets the ExactPlanner recompute part of the "
          "offloaded K/V from layer inputs (KVPR) where its verdict says it pays (MHA): one exact "
          "row per value, side by side");
ABSL_FLAG(double, exact_recompute_share, -1,
          "exact with --exact_fetch_share and --exact_recompute=auto: force this share of the "
          "offloaded entries onto recompute (the rest of 1 - fetch on the CPU nodes)");
ABSL_FLAG(int, offload_steps, 5, "timed decode steps for offload and exact (slow by design)");
ABSL_FLAG(int, exact_calibration_steps, 0,
          "exact rows (planned split): untimed steps whose timings correct the planner's rates "
          "(as a served session's re-plans do), then the context is placed again by them and "
          "timed; 0 = the start-up probe's plan");
ABSL_FLAG(double, exact_fetch_share, -1,
          "exact: force this share of the offloaded entries into host pages (the rest on the CPU "
          "nodes); < 0 = the ExactPlanner's split from rates probed at the first exact row");
ABSL_FLAG(int, warmup, 2, "decode steps before timing");
ABSL_FLAG(int64_t, prefill_tokens, 32768, "TTFT: prompt tokens (0 = skip)");
ABSL_FLAG(int64_t, prefill_chunk, 4096, "tokens per forward pass in prefill");
ABSL_FLAG(float, prefill_beta, 1.0f, "TTFT: hybrid beta");
ABSL_FLAG(std::string, prefill_contexts, "",
          "TTFT: prompt lengths run one after the other in this process (e.g. "
          "32768,131072,524288); empty = --prefill_tokens");
ABSL_FLAG(bool, device_prefill, true,
          "TTFT: offload/hybrid widen the window to hold the prompt (the serving default); "
          "false: chunks attend over the evicted part through the tier");
ABSL_FLAG(int64_t, prefill_headroom_mb, 4096,
          "TTFT: device memory (MiB) left free when the window widens (page summaries, "
          "streaming buffers and the settle need it)");
ABSL_FLAG(int64_t, prefill_widen_mb, 0,
          "TTFT: at most this many MiB more for the widened window (0 = what the device has; "
          "a smaller value emulates --kv_cache_bytes: the rest of the prompt spills)");
ABSL_FLAG(std::string, prefill_selections, "maw", "TTFT: hybrid selections: maw, pages");
ABSL_FLAG(int64_t, prefill_select_tokens, 2048, "TTFT: hybrid pages budget (tokens)");
ABSL_FLAG(unsigned, node_threads, 0, "CPU node attention threads (0 = all cores)");
ABSL_FLAG(uint32_t, node_tasks_per_thread, 2,
          "embedded CPU node: ranges per attention thread a paged Attend is cut into "
          "(NodeOptions::tasks_per_thread; tandem-cpu-attention's --tasks_per_thread)");
ABSL_FLAG(uint32_t, node_prefetch_entries, 256,
          "embedded CPU node: entries a paged scan prefetches ahead (NodeOptions::prefetch_entries)");
ABSL_FLAG(uint32_t, node_dense_tasks_per_thread, 8,
          "embedded CPU node: the same for dense Attends (NodeOptions::dense_tasks_per_thread)");
ABSL_FLAG(bool, node_huge_pages, true, "embedded CPU node: KV blocks on transparent huge pages");
ABSL_FLAG(tandem::ByteSize, node_warm_reserve, tandem::ByteSize{512ull << 20},
          "embedded CPU node: free KV block memory kept faulted in (0 = none)");
ABSL_FLAG(uint32_t, node_pool_spin_us, 0,
          "embedded CPU node: attention threads spin this long after a call before sleeping "
          "(NodeOptions::pool_spin_us; tandem-cpu-attention's --pool_spin_us)");
ABSL_FLAG(uint32_t, shm_fill_threads, 4,
          "threads copying evicted KV into shm appends (NodePoolOptions::shm_fill_threads)");
ABSL_FLAG(uint32_t, shm_spin_us, 10,
          "shm transport: both ends spin this long before sleeping while waiting (the worker for "
          "an answer, the embedded node's channel thread for a request)");
ABSL_FLAG(std::string, node_kv_dtype, "bf16", "embedded CPU node KV storage: bf16 or int8");
ABSL_FLAG(std::string, transport, "auto", "CPU node transport: auto, shm or grpc");
ABSL_FLAG(double, host_fraction, 0.85, "use at most this share of MemAvailable for KV");
ABSL_FLAG(bool, skip_probes, false, "skip the bandwidth probes (limits become 0)");
ABSL_FLAG(std::string, json, "", "also write the JSON lines to this file");
ABSL_FLAG(uint64_t, seed, 1, "random seed");
ABSL_FLAG(std::string, cpu_nodes, "",
          "hybrid: CPU node processes (comma-separated host:port); empty = one node embedded");
ABSL_FLAG(std::string, placements, "balanced",
          "hybrid: shard placements to compare (uniform, balanced)");
ABSL_FLAG(std::string, head_skew, "",
          "hybrid: 'lo:hi' draws each (layer, kv head)'s selected share log-uniformly in "
          "[lo, hi] (HGCA: <1%..30%), replacing --shares; empty = --shares for every head");
ABSL_FLAG(bool, pool_node_rates, true,
          "hybrid: plan nodes with equal thread counts as equally fast (the mean of their "
          "measured scan rates) instead of each node's own measured rate");
ABSL_FLAG(std::string, select_tokens, "",
          "hybrid with selection=pages: budgets (offloaded tokens per layer, kv head and token) "
          "to run, comma-separated; empty = none");
ABSL_FLAG(int64_t, summary_page_tokens, 16, "selection=pages: tokens per summarised page");
ABSL_FLAG(bool, device_marks, false,
          "hybrid rows: time each layer on the device too (RunnerOptions::device_marks): "
          "breakdown_ms gains device_speculate, device_answer_stall, device_tail_head and "
          "host_tail_head_launch (one micro-batch only; four event records per layer)");
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
ABSL_FLAG(int64_t, dense_layers, 0, "selection=pages: first layers attending over every page");
ABSL_FLAG(double, centroid_share, 0.5,
          "selection=pages: share of each budget chosen by q·mean after the rest by Quest's bound");
ABSL_FLAG(std::string, micro_batches, "1,2",
          "hybrid decode: micro-batch settings timed on the same sequences, comma-separated: 1 = "
          "one pass over the batch (GPU and CPU parts add up), 2 = ping-pong (RunnerOptions::"
          "micro_batches); with both, the 2 row reports its ratio to the 1 row");
ABSL_FLAG(double, split_min_scan_share, -1.0,
          "RunnerOptions::split_min_scan_share: off-device scan bytes over weight bytes from "
          "which a pass splits (-1 = the backend's default, 0 = always)");
ABSL_FLAG(double, split_min_scan_bytes, 16e6, "RunnerOptions::split_min_scan_bytes");
ABSL_FLAG(int64_t, settle_tokens_per_step, 1024,
          "TTFT rows: tokens of the prompt's blocks moved to the tier per decode step after the "
          "first token (RunnerOptions::settle_tokens_per_step, the worker's default; 0 = all at "
          "once)");
ABSL_FLAG(int, settle_steps, 3,
          "hybrid: decode steps that measure the shards' costs before balanced placement "
          "re-plans and migrates (outside the timed steps)");

namespace tandem::bench {
namespace {

using gpu_worker::AttentionMode;
using gpu_worker::Backend;
using gpu_worker::ModelConfig;
using gpu_worker::Sequence;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

template <typename T>
std::vector<T> ParseList(const std::string& text) {
  std::vector<T> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    T value{};
    if constexpr (std::is_same_v<T, std::string>) {
      value = std::string(part);
    } else if constexpr (std::is_floating_point_v<T>) {
      double d = 0;
      if (!absl::SimpleAtod(part, &d)) {
        std::fprintf(stderr, "not a number: %s\n", std::string(part).c_str());
        std::exit(2);
      }
      value = static_cast<T>(d);
    } else {
      int64_t i = 0;
      if (!absl::SimpleAtoi(part, &i)) {
        std::fprintf(stderr, "not an integer: %s\n", std::string(part).c_str());
        std::exit(2);
      }
      value = static_cast<T>(i);
    }
    out.push_back(value);
  }
  return out;
}

// /proc/meminfo's MemAvailable, and this process's resident and peak resident set (bytes).
uint64_t ProcField(const char* file, const char* key) {
  std::ifstream in(file);
  std::string line;
  const std::string prefix = std::string(key) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) == 0) {
      uint64_t kb = 0;
      std::sscanf(line.c_str() + prefix.size(), "%lu", &kb);
      return kb * 1024;
    }
  }
  return 0;
}

// The CPU-node session of a hybrid sequence.
gpu_worker::RemoteKv& RemoteOf(Sequence& seq) {
  return static_cast<gpu_worker::NodeTier&>(*seq.offload).remote();
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = p * (v.size() - 1);
  const size_t lo = static_cast<size_t>(rank);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - lo);
}

struct Config {
  AttentionMode mode;
  int64_t context;
  int64_t batch;
  double share;   // hybrid only
  gpu_worker::PlacementPolicy placement = gpu_worker::PlacementPolicy::kBalanced;   // hybrid
  int64_t select_tokens = 0;   // hybrid: > 0 = selection = pages with this budget
  bool exact_recompute = false;   // exact: --exact_recompute=auto
};

// Per-(layer, kv head) shares log-uniform in [lo, hi] from "lo:hi" (deterministic in seed).
std::vector<double> SkewedShares(const std::string& spec, int64_t shards, uint64_t seed) {
  if (spec.empty()) return {};
  std::vector<std::string> parts = absl::StrSplit(spec, ':');
  double lo = 0, hi = 0;
  if (parts.size() != 2 || !absl::SimpleAtod(parts[0], &lo) || !absl::SimpleAtod(parts[1], &hi) ||
      !(lo > 0 && lo <= hi && hi <= 1)) {
    std::fprintf(stderr, "--head_skew must be lo:hi with 0 < lo <= hi <= 1, got %s\n", spec.c_str());
    std::exit(2);
  }
  std::vector<double> shares(shards);
  for (int64_t i = 0; i < shards; ++i) {
    const double u = 0.5 * (gpu_worker::RandomSigned(seed + 7, static_cast<uint64_t>(i), 1.0f) + 1.0);
    shares[i] = std::exp(std::log(lo) + u * (std::log(hi) - std::log(lo)));
  }
  return shares;
}

class Bench {
 public:
  Bench(Backend& backend, const gpu_worker::DeviceModel& model, gpu_worker::ModelRunner& runner,
        gpu_worker::NodePool* pool, const PhysicalLimits& rates)
      : backend_(backend), model_(model), runner_(runner), pool_(pool), rates_(rates) {}

  // Bytes of K+V per token over all layers (bf16).
  double KvBytesPerToken() const {
    const ModelConfig& c = model_.config();
    return 2.0 * c.num_layers * c.num_kv_heads * c.head_dim * 2;
  }

  SyntheticContextOptions ContextOptions(const Config& cfg, int steps) const {
    SyntheticContextOptions o;
    o.context = cfg.context;
    o.extra_positions = absl::GetFlag(FLAGS_warmup) + steps + 8;
    o.window = absl::GetFlag(FLAGS_window);
    o.sink = absl::GetFlag(FLAGS_sink);
    o.block = absl::GetFlag(FLAGS_block);
    o.max_chunk = runner_.options().max_chunk;
    o.page_tokens = absl::GetFlag(FLAGS_page_tokens);
    o.share = cfg.mode == AttentionMode::kHybrid ? cfg.share : 0.1;
    o.seed = absl::GetFlag(FLAGS_seed);
    o.exact_rates = exact_rates_.get();
    o.exact_fetch_share = absl::GetFlag(FLAGS_exact_fetch_share);
    o.exact_recompute = cfg.exact_recompute;
    o.exact_recompute_share = cfg.exact_recompute ? absl::GetFlag(FLAGS_exact_recompute_share) : -1;
    o.model = &model_;
    o.placement = cfg.placement;
    o.pool_node_rates = absl::GetFlag(FLAGS_pool_node_rates);
    o.shm_spin_us = absl::GetFlag(FLAGS_shm_spin_us);
    if (cfg.mode == AttentionMode::kHybrid && cfg.select_tokens > 0) {
      o.selection = gpu_worker::SelectionRule::kPages;
      o.page_policy.select_tokens = cfg.select_tokens;
      o.page_policy.dense_layers = absl::GetFlag(FLAGS_dense_layers);
      o.page_policy.centroid_share = absl::GetFlag(FLAGS_centroid_share);
      o.summary_page_tokens = absl::GetFlag(FLAGS_summary_page_tokens);
      o.low_rank = {absl::GetFlag(FLAGS_page_key_rank), absl::GetFlag(FLAGS_page_key_calib_tokens)};
      o.share = 1.0;   // MAW is not used; nothing is copied
    }
    if (cfg.mode == AttentionMode::kHybrid) {
      const ModelConfig& c = model_.config();
      o.head_shares = SkewedShares(absl::GetFlag(FLAGS_head_skew),
                                   c.num_layers * c.num_kv_heads, o.seed);
    }
    return o;
  }

  // Host bytes a configuration needs (KV beyond the window; hybrid adds its selected copy).
  double HostBytes(const Config& cfg) const {
    if (cfg.mode == AttentionMode::kGpu) return 0;
    const double off = std::max<double>(cfg.context - absl::GetFlag(FLAGS_window), 0);
    const double copy =
        cfg.mode == AttentionMode::kHybrid && cfg.select_tokens == 0 ? 1.0 + cfg.share : 1.0;
    if (cfg.mode == AttentionMode::kHybrid && absl::GetFlag(FLAGS_node_kv_dtype) == "int8") {
      // int8 node rows: head_dim codes + an f32 scale for K and for V, and the f32 MAW.
      const ModelConfig& c = model_.config();
      const double entry = 2.0 * (c.head_dim + 4) + 4;
      return cfg.batch * off * c.num_layers * c.num_kv_heads * entry * copy * 1.03;
    }
    return cfg.batch * off * KvBytesPerToken() * copy * 1.03;
  }

  // One row per --micro_batches setting (non-hybrid modes: one row), timed on the same
  // sequences one setting after the other.
  std::vector<json> RunDecode(const Config& cfg) {
    json r = {{"kind", "decode"},   {"mode", gpu_worker::AttentionModeName(cfg.mode)},
              {"context", cfg.context}, {"batch", cfg.batch}};
    if (cfg.mode == AttentionMode::kHybrid && cfg.select_tokens > 0) {
      r["selection"] = "pages";
      r["select_tokens"] = cfg.select_tokens;
      r["summary_page_tokens"] = absl::GetFlag(FLAGS_summary_page_tokens);
      r["dense_layers"] = absl::GetFlag(FLAGS_dense_layers);
    } else if (cfg.mode == AttentionMode::kHybrid) {
      r["share"] = cfg.share;
    }
    if (cfg.mode == AttentionMode::kHybrid) {
      r["placement"] = cfg.placement == gpu_worker::PlacementPolicy::kBalanced ? "balanced"
                                                                                : "uniform";
      if (!absl::GetFlag(FLAGS_head_skew).empty()) r["head_skew"] = absl::GetFlag(FLAGS_head_skew);
      r["pool_node_rates"] = absl::GetFlag(FLAGS_pool_node_rates);
      r["cpu_nodes"] = pool_ != nullptr ? pool_->accepting_count() : 0;
    }
    const double need = HostBytes(cfg);
    const double avail = absl::GetFlag(FLAGS_host_fraction) *
                         static_cast<double>(ProcField("/proc/meminfo", "MemAvailable"));
    // Remote nodes bound their memory with their own pools (and refuse what does not fit).
    if (need > avail && absl::GetFlag(FLAGS_cpu_nodes).empty()) {
      r["skipped"] = absl::StrFormat("needs %.1f GB of host memory, %.1f GB available", need / 1e9,
                                     avail / 1e9);
      return {r};
    }
    const bool slow = cfg.mode == AttentionMode::kOffload || cfg.mode == AttentionMode::kExact;
    const int steps = slow ? absl::GetFlag(FLAGS_offload_steps) : absl::GetFlag(FLAGS_steps);
    if (cfg.mode == AttentionMode::kExact && exact_rates_ == nullptr) {
      // The exact planner's rates, probed once (exact_probe.h) like the serving engine does.
      const ModelConfig& c = model_.config();
      auto book = gpu_worker::ExactRateBook::Measure(
          backend_, *pool_, {c.num_layers, c.num_kv_heads, c.head_dim, c.hidden_size, 2, 2},
          gpu_worker::DType::kBF16);
      if (!book.ok()) {
        r["skipped"] = absl::StrCat("exact rates: ", book.status().message());
        return {r};
      }
      exact_rates_ = std::move(*book);
    }
    std::vector<int> settings = {2};
    if (cfg.mode == AttentionMode::kHybrid) {
      settings.clear();
      for (int64_t m : ParseList<int64_t>(absl::GetFlag(FLAGS_micro_batches))) {
        settings.push_back(static_cast<int>(m));
      }
    }
    const int warmup = absl::GetFlag(FLAGS_warmup);
    // Room for every decode step a context takes: the timed ones, and for exact the calibration.
    const int calibration_steps =
        cfg.mode == AttentionMode::kExact ? absl::GetFlag(FLAGS_exact_calibration_steps) : 0;
    const SyntheticContextOptions o = ContextOptions(
        cfg, static_cast<int>(settings.size()) * (warmup + steps) + calibration_steps);
    std::vector<std::unique_ptr<Sequence>> seqs;
    // The batch's synthetic contexts into seqs (false: r says why they were skipped).
    auto fill = [&]() {
      for (int64_t b = 0; b < cfg.batch; ++b) {
        auto seq = MakeSyntheticSequence(backend_, model_.config(), pool_, cfg.mode,
                                         absl::StrCat("bench-", ++session_counter_), o);
        if (!seq.ok()) {
          r["skipped"] = std::string(seq.status().message());
          return false;
        }
        seqs.push_back(std::move(*seq));
      }
      return true;
    };
    const Clock::time_point fill_start = Clock::now();
    if (!fill()) return {r};
    r["fill_s"] = Seconds(fill_start);
    if (cfg.mode == AttentionMode::kExact && absl::GetFlag(FLAGS_exact_calibration_steps) > 0 &&
        absl::GetFlag(FLAGS_exact_fetch_share) < 0) {
      // As a served session converges (its sliced settle appends by plans re-made from timed
      // steps): untimed steps correct the rate book (ExactRateBook::RecordStep via Maintain),
      // then the context is placed again by the corrected rates and that one is timed.
      const gpu_worker::ExactPathRates start = exact_rates_->rates();
      const int calibration = absl::GetFlag(FLAGS_exact_calibration_steps);
      std::vector<Sequence*> all;
      for (auto& s : seqs) all.push_back(s.get());
      const std::vector<int32_t> calibration_ids(cfg.batch, 1);
      for (int step = 0; step < calibration; ++step) {
        absl::Status st = runner_.Decode(all, calibration_ids.data());
        if (st.ok()) st = backend_.Synchronize();
        if (!st.ok()) {
          r["error"] = absl::StrCat("exact calibration: ", st.message());
          return {r};
        }
        for (auto& s : seqs) s->MaintainOffloaded();
      }
      const gpu_worker::ExactPathRates& end = exact_rates_->rates();
      r["exact_calibration"] = {{"steps", calibration},
                                {"node_GBps", {start.node_bytes_per_second / 1e9,
                                               end.node_bytes_per_second / 1e9}},
                                {"pcie_GBps", {start.pcie_bytes_per_second / 1e9,
                                               end.pcie_bytes_per_second / 1e9}},
                                {"node_overhead_us", {1e6 * start.node_overhead_seconds,
                                                      1e6 * end.node_overhead_seconds}}};
      seqs.clear();   // its host pages and node session go before the second placement
      const Clock::time_point refill = Clock::now();
      if (!fill()) return {r};
      r["refill_s"] = Seconds(refill);
    }
    std::vector<Sequence*> batch;
    for (auto& s : seqs) batch.push_back(s.get());
    std::vector<int32_t> ids(cfg.batch);
    const int64_t vocab = model_.config().vocab_size;
    if (cfg.mode == AttentionMode::kHybrid) {
      // Costs come from Attend replies: a few steps measure them, then balanced placement
      // re-plans and migrates (timed apart). Uniform runs the same steps and stays put.
      for (int step = 0; step < absl::GetFlag(FLAGS_settle_steps); ++step) {
        for (int64_t b = 0; b < cfg.batch; ++b) ids[b] = static_cast<int32_t>((step * 31 + b) % vocab);
        absl::Status s = runner_.Decode(batch, ids.data());
        if (s.ok()) s = backend_.Synchronize();
        if (!s.ok()) {
          r["error"] = std::string(s.message());
          return {r};
        }
      }
      const Clock::time_point m0 = Clock::now();
      uint64_t moved = 0, failed = 0;
      double modelled = 0, plan_ms = 0;
      for (auto& seq : seqs) {
        if (cfg.placement == gpu_worker::PlacementPolicy::kBalanced) RemoteOf(*seq).RequestReplan();
        absl::Status s = RemoteOf(*seq).SettleMigrations(std::chrono::minutes(9));
        if (!s.ok()) {
          r["error"] = absl::StrCat("migration: ", s.message());
          return {r};
        }
        const gpu_worker::PlacementCounters& pc = RemoteOf(*seq).placement_counters();
        moved += pc.migrations_done;
        failed += pc.migrations_failed;
        modelled += RemoteOf(*seq).ModelledStepSeconds();
        plan_ms = std::max(plan_ms, pc.last_plan_ms);
        r["nodes_in_use"] = RemoteOf(*seq).nodes_in_use().size();
      }
      r["migration_s"] = Seconds(m0);
      r["shards_migrated"] = moved;
      r["migrations_failed"] = failed;
      r["modelled_cpu_ms"] = 1e3 * modelled;
      r["plan_ms"] = plan_ms;
    }
    std::vector<json> out;
    double serial_ms = 0, serial_cpu_wait_ms = 0;   // the micro_batches = 1 row
    for (int setting : settings) {
      json row = r;
      row["micro_batches"] = setting;
      if (absl::Status s = runner_.SetMicroBatches(setting); !s.ok()) {
        row["error"] = std::string(s.message());
        out.push_back(row);
        continue;
      }
      TimeDecode(cfg, batch, steps, row);
      if (row.contains("error")) {
        out.push_back(row);
        break;
      }
      // Only hybrid rows have a breakdown (gpu and offload rows: no CPU wait).
      const double cpu_wait_ms =
          row.contains("breakdown_ms") ? row["breakdown_ms"].value("cpu_wait", 0.0) : 0.0;
      if (setting == 1) {
        serial_ms = row["decode_ms_median"].get<double>();
        serial_cpu_wait_ms = cpu_wait_ms;
      } else if (serial_ms > 0) {
        // The serial step is the GPU part plus the CPU part (only each layer's window attention
        // overlaps the nodes there); its cpu_wait is the CPU part the host waited for.
        row["serial_ms"] = serial_ms;
        row["serial_parts_ms"] = {{"gpu", serial_ms - serial_cpu_wait_ms},
                                  {"cpu_wait", serial_cpu_wait_ms}};
        row["ratio_to_serial"] = row["decode_ms_median"].get<double>() / serial_ms;
      }
      out.push_back(row);
    }
    runner_.SetMicroBatches(2).IgnoreError();
    return out;
  }

  // Times --warmup + steps decode steps of `batch` with the runner as set, and adds the
  // measurements, the traffic of one step and its limits to r.
  void TimeDecode(const Config& cfg, const std::vector<Sequence*>& batch, int steps, json& r) {
    const int64_t vocab = model_.config().vocab_size;
    const int warmup = absl::GetFlag(FLAGS_warmup);
    std::vector<int32_t> ids(cfg.batch);
    std::vector<double> times;
    uint64_t peak_device = 0;
    for (int step = 0; step < warmup + steps; ++step) {
      for (int64_t b = 0; b < cfg.batch; ++b) ids[b] = static_cast<int32_t>((step * 7919 + b * 131) % vocab);
      if (step == warmup) runner_.ResetProfile();
      const Clock::time_point t0 = Clock::now();
      absl::Status s = runner_.Decode(batch, ids.data());
      if (s.ok()) s = backend_.Synchronize();
      const double dt = Seconds(t0);
      if (!s.ok()) {
        r["error"] = std::string(s.message());
        return;
      }
      if (step >= warmup) times.push_back(dt);
      auto used = backend_.DeviceMemoryUsed();
      if (used.ok()) peak_device = std::max<uint64_t>(peak_device, *used);
    }
    const double median = Percentile(times, 0.5);
    r["decode_ms_median"] = 1e3 * median;
    r["decode_ms_p99"] = 1e3 * Percentile(times, 0.99);
    r["tokens_per_s"] = cfg.batch / median;
    r["peak_gpu_bytes"] = peak_device;
    r["host_rss_bytes"] = ProcField("/proc/self/status", "VmRSS");
    r["weight_bytes"] = model_.weight_bytes();
    if (cfg.mode != AttentionMode::kGpu) {
      // Issue 4's memory target: weights + the window's KV + 2 GB, whatever the context.
      const double window_bytes = cfg.batch *
                                  static_cast<double>(absl::GetFlag(FLAGS_sink) +
                                                      absl::GetFlag(FLAGS_window)) *
                                  KvBytesPerToken();
      const double budget = model_.weight_bytes() + window_bytes + 2e9;
      r["gpu_budget_bytes"] = budget;
      r["gpu_within_budget"] = peak_device <= budget;
    }
    uint64_t degraded = 0;
    for (Sequence* s : batch) degraded += s->degraded_steps;
    r["degraded_steps"] = degraded;

    // Traffic of one step and its limit.
    const ModelConfig& c = model_.config();
    Traffic t;
    double device_tokens = 0, offloaded_tokens = 0;
    for (Sequence* s : batch) {
      device_tokens += s->device_entries();
      offloaded_tokens += s->offloaded_entries();
    }
    t.hbm_bytes = model_.weight_bytes() + device_tokens * KvBytesPerToken();
    if (cfg.mode == AttentionMode::kOffload) {
      t.pcie_bytes = offloaded_tokens * KvBytesPerToken();
      t.hbm_bytes += offloaded_tokens * KvBytesPerToken() * 2;   // staged: written, then read
    }
    if (cfg.mode == AttentionMode::kExact) {
      // The host share crosses PCIe (and is staged in HBM); the nodes scan the rest at once.
      // Recomputed entries cross as layer inputs (hidden · 2 B per layer, bf16 weights).
      double host = 0, nodes = 0, recomputed = 0;
      for (Sequence* s : batch) {
        const auto& tier = static_cast<const gpu_worker::ExactTier&>(*s->offload);
        host += tier.host_tokens();
        nodes += tier.node_tokens();
        recomputed += tier.recompute_tokens();
      }
      const double activation_bytes =
          static_cast<double>(model_.config().num_layers) * model_.config().hidden_size * 2;
      t.pcie_bytes = host * KvBytesPerToken() + recomputed * activation_bytes;
      t.hbm_bytes += host * KvBytesPerToken() * 2;
      t.cpu_scan_bytes = nodes * KvBytesPerToken();
      const gpu_worker::ExactPlan& plan =
          static_cast<const gpu_worker::ExactTier&>(*batch[0]->offload).plan();
      r["exact_plan"] = {{"fetch_share", plan.fetch_share},
                         {"node_share", plan.node_share},
                         {"recompute_share", plan.recompute_share},
                         {"modelled_step_ms", 1e3 * plan.step_seconds},
                         {"modelled_fetch_only_ms", 1e3 * plan.fetch_only_seconds},
                         {"recompute_pays", plan.recompute_pays},
                         {"recompute_gain", plan.recompute_gain},
                         {"recompute_reason", plan.recompute_reason},
                         {"text", gpu_worker::FormatExactPlan(plan)}};
      r["exact_rates"] = gpu_worker::FormatExactRates(exact_rates_->rates());
      // The planner's rates: the paths at once (the split) and alone (the limits), GB/s.
      const gpu_worker::ExactPathRates& er = exact_rates_->rates();
      r["exact_rates_GBps"] = {{"pcie", er.pcie_bytes_per_second / 1e9},
                               {"pcie_alone", er.pcie_alone() / 1e9},
                               {"nodes", er.node_bytes_per_second / 1e9},
                               {"nodes_alone", er.node_alone() / 1e9},
                               {"device_attend", er.device_attend_bytes_per_second / 1e9}};
      if (plan.step_seconds > 0) {
        r["exact_plan"]["measured_over_modelled"] = median / plan.step_seconds;
      }
      // Where the timed steps went per path (ExactStepClock; warm-up included; one step in
      // ExactTierOptions::time_every_steps): the nodes' attends, the fetched pages finishing
      // after them, the layers' tails (both paths wait for the next q), the layers' spans.
      gpu_worker::ExactStepTimes timed;
      for (Sequence* s : batch) {
        timed += static_cast<const gpu_worker::ExactTier&>(*s->offload).measured_steps();
      }
      if (timed.steps > 0) {
        const gpu_worker::ExactStepTimes per = timed.PerStep();
        r["exact_step_ms"] = {{"node_busy", 1e3 * per.node_busy_s},
                              {"fetch_excess", 1e3 * per.fetch_excess_s},
                              {"tail", 1e3 * per.tail_s},
                              {"span", 1e3 * per.span_s},
                              {"timed_steps", timed.steps}};
      }
      r["host_entries"] = host;
      r["node_entries"] = nodes;
      r["recompute_entries"] = recomputed;
      r["exact_recompute"] = cfg.exact_recompute ? "auto" : "off";
      // The issue's combined limit: all offloaded bytes over PCIe + CPU scan together.
      if (rates_.pcie_bytes_per_s > 0 && rates_.cpu_scan_bytes_per_s > 0) {
        r["combined_limit_ms"] = 1e3 * (host + nodes + recomputed) * KvBytesPerToken() /
                                 (rates_.pcie_bytes_per_s + rates_.cpu_scan_bytes_per_s);
        r["ratio_to_combined_limit"] = median / (r["combined_limit_ms"].get<double>() / 1e3);
      }
      const gpu_worker::RunnerProfile& p = runner_.profile();
      const double per_step = 1e3 / std::max<uint64_t>(p.passes, 1);
      r["breakdown_ms"] = {{"q_download_wait_for_gpu", p.q_download_s * per_step},
                           {"cpu_wait", p.cpu_wait_s * per_step},
                           {"merge_upload", p.merge_upload_s * per_step},
                           {"host_pass", p.pass_s * per_step}};
    }
    if (cfg.mode == AttentionMode::kHybrid) {
      double selected_share = 0;   // measured on the node: selected / held over the layers
      uint64_t selected = 0, held = 0;
      for (Sequence* s : batch) {
        for (const auto& layer : RemoteOf(*s).last_selection()) {
          selected += layer.selected;
          held += layer.held;
        }
      }
      selected_share = held ? static_cast<double>(selected) / held : 0;
      r["selected_share_measured"] = selected_share;
      uint64_t shm_attends = 0;
      for (Sequence* s : batch) shm_attends += RemoteOf(*s).shm_attends();
      r["shm_attends"] = shm_attends;
      t.cpu_scan_bytes = offloaded_tokens * selected_share * KvBytesPerToken();
      t.pcie_bytes = cfg.batch * c.num_layers * c.num_q_heads * (2.0 * c.head_dim + 1) * 4;
      const gpu_worker::RunnerProfile& p = runner_.profile();
      const double per_step = 1e3 / std::max<uint64_t>(p.passes, 1);
      r["breakdown_ms"] = {{"q_download_wait_for_gpu", p.q_download_s * per_step},
                           {"page_select", p.select_s * per_step},
                           {"cpu_wait", p.cpu_wait_s * per_step},
                           {"attend_round_trip", p.attend_round_trip_s * per_step},
                           {"node_handle", p.node_handle_s * per_step},
                           {"node_compute", p.node_compute_s * per_step},
                           {"merge_upload", p.merge_upload_s * per_step},
                           {"host_pass", p.pass_s * per_step}};
      if (p.device_marked_layers > 0) {
        json& b = r["breakdown_ms"];
        b["device_speculate"] = p.device_speculate_s * per_step;
        b["device_answer_stall"] = p.device_answer_stall_s * per_step;
        b["device_tail_head"] = p.device_tail_head_s * per_step;
        b["host_tail_head_launch"] = p.host_tail_head_launch_s * per_step;
        r["device_marked_layers_per_step"] = static_cast<double>(p.device_marked_layers) /
                                             std::max<uint64_t>(p.passes, 1);
      }
      r["split_passes"] = p.split_passes;
      double summary_bytes = 0;
      for (Sequence* s : batch) {
        const gpu_worker::PageIndex* index =
            s->offload != nullptr ? s->offload->page_index() : nullptr;
        if (index == nullptr) continue;
        const auto& g = index->geometry();
        // Summary rows a step reads: min and max for the bound's pass, the mean for the
        // centroid's (PagePolicy::SplitPages, as NodeTier::ChoosePages divides the budget).
        const gpu_worker::PagePolicy& policy = *s->offload->page_policy();
        const auto split = policy.SplitPages(
            std::max<int64_t>(1, policy.select_tokens / index->page_tokens()));
        const int rows = (split.bound > 0 ? 2 : 0) + (split.centroid > 0 ? 1 : 0);
        for (int64_t l = 0; l < g.num_layers; ++l) {
          summary_bytes += static_cast<double>(index->num_pages(l)) * g.num_kv_heads * rows *
                           g.head_dim * gpu_worker::DTypeBytes(g.dtype);
        }
      }
      if (summary_bytes > 0) {
        r["summary_bytes"] = summary_bytes;
        if (rates_.hbm_bytes_per_s > 0 && rates_.cpu_scan_bytes_per_s > 0) {
          const double own = t.hbm_bytes / rates_.hbm_bytes_per_s;
          const double sum = t.cpu_scan_bytes / rates_.cpu_scan_bytes_per_s +
                             summary_bytes / rates_.hbm_bytes_per_s + own;
          r["limit_sum_ms"] = 1e3 * sum;
          r["limit_sum_terms_ms"] = {
              {"cpu_scan", 1e3 * t.cpu_scan_bytes / rates_.cpu_scan_bytes_per_s},
              {"summaries_hbm", 1e3 * summary_bytes / rates_.hbm_bytes_per_s},
              {"gpu_own", 1e3 * own}};
          r["ratio_to_limit_sum"] = median / sum;
        }
        t.hbm_bytes += summary_bytes;
      }
    }
    auto limit = ComputeLimit(rates_, t);
    if (limit.ok()) {
      r["limit_ms"] = 1e3 * limit->seconds;
      r["limit_bound"] = std::string(LimitTermName(limit->bound));
      r["limit_terms_ms"] = {{"hbm", 1e3 * limit->hbm_seconds},
                             {"cpu_scan", 1e3 * limit->cpu_scan_seconds},
                             {"pcie", 1e3 * limit->pcie_seconds}};
      if (limit->seconds > 0) r["ratio_to_limit"] = median / limit->seconds;
    }
    r["traffic_bytes"] = {{"hbm", t.hbm_bytes}, {"cpu_scan", t.cpu_scan_bytes}, {"pcie", t.pcie_bytes}};
  }

  json RunPrefill(AttentionMode mode, int64_t tokens,
                  gpu_worker::SelectionRule selection = gpu_worker::SelectionRule::kMaw) {
    json r = {{"kind", "prefill"}, {"mode", gpu_worker::AttentionModeName(mode)},
              {"context", tokens}, {"batch", 1}};
    const bool pages = mode == AttentionMode::kHybrid &&
                       selection == gpu_worker::SelectionRule::kPages;
    if (mode == AttentionMode::kHybrid) r["selection"] = pages ? "pages" : "maw";
    const ModelConfig& c = model_.config();
    gpu_worker::WindowOptions wo;
    wo.block = absl::GetFlag(FLAGS_block);
    wo.max_chunk = runner_.options().max_chunk;
    // The prompt, then one decode token per settle slice (a slice moves whole blocks, at least
    // one: at most tokens / moved + 1 of them).
    const int64_t slice = runner_.options().settle_tokens_per_step;
    const int64_t block = std::max<int64_t>(absl::GetFlag(FLAGS_block), 1);
    const int64_t moved = std::max(block, slice / block * block);
    wo.max_context = tokens + 8 + (slice > 0 ? tokens / moved + 1 : 0);
    const bool windowed = mode != AttentionMode::kGpu;
    wo.window = windowed ? absl::GetFlag(FLAGS_window) : gpu_worker::WindowOptions::kUnlimited;
    wo.sink = windowed ? absl::GetFlag(FLAGS_sink) : 0;
    const gpu_worker::WindowGeometry g{c.num_layers, c.num_kv_heads, c.head_dim,
                                       gpu_worker::DType::kBF16};
    auto window = gpu_worker::WindowCache::Create(backend_, g, wo);
    if (!window.ok()) {
      r["skipped"] = absl::StrCat("the KV does not fit the device: ", window.status().message());
      return r;
    }
    auto seq = std::make_unique<Sequence>(absl::StrCat("prefill-", ++session_counter_), mode,
                                          std::move(*window));
    // The serving path's tier (Engine::NewSequence): a node session with page summaries on the
    // device (hybrid), host pages (offload).
    gpu_worker::TierSpec tier;
    tier.mode = mode;
    tier.geometry = g;
    gpu_worker::RemoteKvOptions& ro = tier.node;
    ro.session_id = seq->id;
    ro.num_layers = c.num_layers;
    ro.num_q_heads = c.num_q_heads;
    ro.num_kv_heads = c.num_kv_heads;
    ro.head_dim = c.head_dim;
    ro.kv_dtype = gpu_worker::DType::kBF16;
    ro.beta = absl::GetFlag(FLAGS_prefill_beta);
    ro.block_tokens = static_cast<uint32_t>(std::clamp<int64_t>(wo.block, 16, 256));
    ro.attend_deadline_ms = 60000;
    ro.control_deadline_ms = 600000;
    ro.shm_spin_us = absl::GetFlag(FLAGS_shm_spin_us);
    ro.expected_tokens = tokens;
    if (mode == AttentionMode::kHybrid && pages) {
      ro.selection = gpu_worker::SelectionRule::kPages;
      ro.page_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_summary_page_tokens));
      tier.summary_tokens = tokens;
      tier.low_rank = {absl::GetFlag(FLAGS_page_key_rank),
                       absl::GetFlag(FLAGS_page_key_calib_tokens)};
    }
    tier.host_page_tokens = absl::GetFlag(FLAGS_page_tokens);
    auto opened = gpu_worker::OpenOffloadTier(backend_, pool_, tier);
    if (!opened.ok()) {
      r["skipped"] = std::string(opened.status().message());
      return r;
    }
    seq->offload = std::move(*opened);  // null in gpu mode (no tier)
    if (gpu_worker::PagePolicy* policy =
            seq->offload != nullptr ? seq->offload->page_policy() : nullptr) {
      policy->select_tokens = absl::GetFlag(FLAGS_prefill_select_tokens);
      r["select_tokens"] = policy->select_tokens;
    }
    std::vector<int32_t> ids(tokens);
    for (int64_t i = 0; i < tokens; ++i) ids[i] = static_cast<int32_t>((i * 48271 + 11) % c.vocab_size);
    const bool device_prefill = windowed && absl::GetFlag(FLAGS_device_prefill);
    r["device_prefill"] = device_prefill;
    const Clock::time_point t0 = Clock::now();
    // The serving path (Engine::WidenForPrefill): the window widens for the whole prompt, here
    // as far as the device allows with the headroom held back, and narrows after its last pass.
    seq->prefill_end = tokens;
    absl::Status s;
    const gpu_worker::PrefillSpillTier* spill_tier = nullptr;   // while a prompt spills
    if (device_prefill) {
      const int64_t widen_mb = absl::GetFlag(FLAGS_prefill_widen_mb);
      const size_t widen_bytes = widen_mb > 0 ? static_cast<size_t>(widen_mb) << 20
                                              : std::numeric_limits<size_t>::max();
      auto headroom = backend_.Allocate(static_cast<size_t>(
          std::max<int64_t>(absl::GetFlag(FLAGS_prefill_headroom_mb), 1)) << 20);
      auto widened = headroom.ok()
                         ? seq->window.WidenWithin(tokens, widen_bytes)
                         : absl::StatusOr<int64_t>(headroom.status());
      s = widened.status();
      if (s.ok()) r["widened_window"] = *widened;
      // Part of the prompt leaves the device: hybrid attends over it from host pages on the
      // device during the prefill (the engine's PrefillSpillTier), not on the CPU node.
      if (s.ok() && *widened < tokens && mode == AttentionMode::kHybrid) {
        auto kv = gpu_worker::OffloadedKv::Create(backend_, g, absl::GetFlag(FLAGS_page_tokens));
        s = kv.status();
        if (s.ok()) {
          auto spill = std::make_unique<gpu_worker::PrefillSpillTier>(
              std::move(seq->offload), std::make_unique<gpu_worker::HostTier>(std::move(*kv)));
          spill_tier = spill.get();
          seq->offload = std::move(spill);
          r["spilled_to_host"] = true;
        }
      }
    }
    if (s.ok()) s = runner_.Forward(*seq, ids.data(), tokens);
    absl::StatusOr<int32_t> first = s.ok() ? backend_.Sample({runner_.last_logits(), c.vocab_size})
                                           : absl::StatusOr<int32_t>(s);
    const double ttft = Seconds(t0);
    if (!first.ok()) {
      r["error"] = std::string(first.status().message());
      return r;
    }
    auto used = backend_.DeviceMemoryUsed();
    if (used.ok()) r["gpu_bytes_at_first_token"] = *used;
    // The first token is out; the host copy is dropped and the blocks beyond the window go to
    // the tier.
    if (spill_tier != nullptr) r["spilled_tokens"] = spill_tier->spilled_tokens();
    seq->EndPrefillSpill();
    // The serving path (Engine::Step): each decode step (pass, sample) is followed by a settle
    // slice; a step's time includes both.
    const int64_t per_step = runner_.options().settle_tokens_per_step;
    int32_t token = *first;
    double worst_step = 0.0;
    int64_t settle_steps = 0;
    std::vector<double> step_ms;
    const gpu_worker::RunnerProfile before = runner_.profile();
    while (s.ok() && seq->window.settling()) {
      const Clock::time_point step0 = Clock::now();
      s = runner_.Forward(*seq, &token, 1);
      absl::StatusOr<int32_t> next =
          s.ok() ? backend_.Sample({runner_.last_logits(), c.vocab_size})
                 : absl::StatusOr<int32_t>(s);
      s = next.status();
      if (s.ok()) {
        token = *next;
        s = runner_.SettleSlice(*seq, runner_.options().settle_budget_per_step()).status();
      }
      if (s.ok()) s = backend_.Synchronize();
      worst_step = std::max(worst_step, Seconds(step0));
      step_ms.push_back(1e3 * Seconds(step0));
      ++settle_steps;
    }
    const gpu_worker::RunnerProfile& after = runner_.profile();
    if (!s.ok()) {
      r["error"] = absl::StrCat("settle: ", s.message());
      return r;
    }
    const double settled = Seconds(t0);
    r["ttft_s"] = ttft;
    r["settled_s"] = settled;
    r["settle_tokens_per_step"] = per_step;
    r["settle_steps"] = settle_steps;
    r["settle_step_max_s"] = worst_step;
    r["settle_step_ms"] = step_ms;
    // Where the settle's host time went, summed over its steps (RunnerProfile::evict_*).
    r["settle_parts_s"] = {{"index", after.evict_index_s - before.evict_index_s},
                           {"read", after.evict_read_s - before.evict_read_s},
                           {"append", after.evict_append_s - before.evict_append_s}};
    r["prefill_tokens_per_s"] = tokens / ttft;
    r["device_entries"] = seq->device_entries();
    r["offloaded_entries"] = seq->offloaded_entries();
    used = backend_.DeviceMemoryUsed();
    if (used.ok()) r["gpu_bytes_after"] = *used;
    return r;
  }

 private:
  Backend& backend_;
  const gpu_worker::DeviceModel& model_;
  gpu_worker::ModelRunner& runner_;
  gpu_worker::NodePool* pool_;
  PhysicalLimits rates_;
  uint64_t session_counter_ = 0;
  std::unique_ptr<gpu_worker::ExactRateBook> exact_rates_;   // probed at the first exact row
};

void PrintTable(const std::vector<json>& rows) {
  std::printf("\n%-20s %8s %5s %11s %11s %9s %10s %-8s %7s %9s %9s\n", "mode", "context", "batch",
              "median ms", "p99 ms", "tok/s", "limit ms", "bound", "ratio", "GPU GB", "host GB");
  for (const json& r : rows) {
    if (r["kind"] != "decode") continue;
    std::string mode = r["mode"];
    if (r.contains("select_tokens")) {
      mode += absl::StrFormat("@p%lld", static_cast<long long>(r["select_tokens"].get<int64_t>()));
    } else if (r.contains("head_skew")) {
      mode += "@skew";
    } else if (r.contains("share")) {
      mode += absl::StrFormat("@%g%%", 100 * r["share"].get<double>());
    }
    if (r.contains("placement")) {
      mode += absl::StrFormat("/%s%lld", r["placement"].get<std::string>().substr(0, 3),
                              static_cast<long long>(r.value("cpu_nodes", 0)));
    }
    if (r.contains("micro_batches")) {
      mode += absl::StrFormat("/mb%d", r["micro_batches"].get<int>());
    }
    if (r.contains("skipped") || r.contains("error")) {
      std::printf("%-20s %8lld %5lld   skipped: %s\n", mode.c_str(),
                  static_cast<long long>(r["context"].get<int64_t>()),
                  static_cast<long long>(r["batch"].get<int64_t>()),
                  r.value("skipped", r.value("error", std::string())).c_str());
      continue;
    }
    std::printf("%-20s %8lld %5lld %11.2f %11.2f %9.1f %10.2f %-8s %7.2f %9.2f %9.2f\n",
                mode.c_str(), static_cast<long long>(r["context"].get<int64_t>()),
                static_cast<long long>(r["batch"].get<int64_t>()),
                r["decode_ms_median"].get<double>(), r["decode_ms_p99"].get<double>(),
                r["tokens_per_s"].get<double>(), r.value("limit_ms", 0.0),
                r.value("limit_bound", std::string("-")).c_str(), r.value("ratio_to_limit", 0.0),
                r["peak_gpu_bytes"].get<double>() / 1e9, r["host_rss_bytes"].get<double>() / 1e9);
  }
  for (const json& r : rows) {
    if (r["kind"] != "decode" || !r.contains("ratio_to_serial")) continue;
    std::printf("ping-pong %s context %lld batch %lld: %.2f ms vs %.2f ms serial (GPU %.2f + CPU "
                "wait %.2f): %.2fx\n",
                r["mode"].get<std::string>().c_str(),
                static_cast<long long>(r["context"].get<int64_t>()),
                static_cast<long long>(r["batch"].get<int64_t>()),
                r["decode_ms_median"].get<double>(), r["serial_ms"].get<double>(),
                r["serial_parts_ms"]["gpu"].get<double>(),
                r["serial_parts_ms"]["cpu_wait"].get<double>(), r["ratio_to_serial"].get<double>());
  }
  for (const json& r : rows) {
    if (r["kind"] != "prefill" || !r.contains("ttft_s")) continue;
    const std::string mode = r["mode"].get<std::string>() +
                             (r.contains("selection") ? "@" + r["selection"].get<std::string>() : "");
    std::printf("prefill %-14s %lld tokens: TTFT %.2f s, %.0f tokens/s, settled %.2f s (%lld "
                "decode steps, slowest %.0f ms)%s\n",
                mode.c_str(), static_cast<long long>(r["context"].get<int64_t>()),
                r["ttft_s"].get<double>(), r["prefill_tokens_per_s"].get<double>(),
                r["settled_s"].get<double>(), static_cast<long long>(r["settle_steps"].get<int64_t>()),
                1e3 * r["settle_step_max_s"].get<double>(),
                r.contains("widened_window")
                    ? absl::StrFormat(" (window widened to %lld)",
                                      static_cast<long long>(r["widened_window"].get<int64_t>()))
                          .c_str()
                    : "");
    const json& parts = r["settle_parts_s"];
    std::printf("  settle host time: index %.0f ms, read %.0f ms, append %.0f ms; steps ms:",
                1e3 * parts["index"].get<double>(), 1e3 * parts["read"].get<double>(),
                1e3 * parts["append"].get<double>());
    for (const json& ms : r["settle_step_ms"]) std::printf(" %.0f", ms.get<double>());
    std::printf("\n");
  }
}

int Main() {
  auto config = gpu_worker::GeometryPreset(absl::GetFlag(FLAGS_preset));
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  if (absl::Status s = gpu_worker::ApplyGeometryOverrides(absl::GetFlag(FLAGS_set), *config);
      !s.ok()) {
    std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 2;
  }
  gpu_worker::BackendOptions backend_options;
  {
    auto prefill = gpu_worker::ParsePrefillAttention(absl::GetFlag(FLAGS_prefill_attention));
    if (!prefill.ok()) {
      std::fprintf(stderr, "--%s\n", std::string(prefill.status().message()).c_str());
      return 2;
    }
    backend_options.prefill_attention = *prefill;
  }
  const std::string backend_name = absl::GetFlag(FLAGS_backend);
  auto backend = backend_name == "cpu" ? gpu_worker::CreateCpuBackend(0, backend_options)
                                       : gpu_worker::CreateCudaBackend(0, backend_options);
  if (!backend.ok()) {
    std::fprintf(stderr, "backend: %s\n", std::string(backend.status().message()).c_str());
    return 1;
  }
  Backend& be = **backend;
  std::vector<json> rows;
  std::ofstream json_file;
  if (!absl::GetFlag(FLAGS_json).empty()) json_file.open(absl::GetFlag(FLAGS_json));
  auto emit = [&](json r) {
    std::printf("%s\n", r.dump().c_str());
    std::fflush(stdout);
    if (json_file) json_file << r.dump() << "\n" << std::flush;
    rows.push_back(std::move(r));
  };

  // 1. The machine's rates.
  PhysicalLimits rates;
  const std::string prefill_name(
      gpu_worker::PrefillAttentionName(backend_options.prefill_attention));
  json probe = {{"kind", "probe"},
               {"device", be.device_description()},
               {"prefill_attention", prefill_name}};
  const unsigned node_threads = absl::GetFlag(FLAGS_node_threads);
  if (!absl::GetFlag(FLAGS_skip_probes)) {
    auto hbm = MeasureDeviceCopyBandwidth(be);
    auto up = MeasureUploadBandwidth(be);
    auto scan = MeasureCpuScanRate(node_threads);
    if (!hbm.ok() || !up.ok() || !scan.ok()) {
      std::fprintf(stderr, "probe failed: %s %s %s\n", std::string(hbm.status().message()).c_str(),
                   std::string(up.status().message()).c_str(),
                   std::string(scan.status().message()).c_str());
      return 1;
    }
    rates = {*hbm, scan->scan_bytes_per_s, up->h2d_bytes_per_s};
    probe["hbm_copy_GBps"] = *hbm / 1e9;
    probe["h2d_GBps"] = up->h2d_bytes_per_s / 1e9;
    probe["d2h_GBps"] = up->d2h_bytes_per_s / 1e9;
    probe["h2d_with_d2h_GBps"] = up->h2d_with_d2h_bytes_per_s / 1e9;
    probe["cpu_scan_GBps"] = scan->scan_bytes_per_s / 1e9;
    probe["cpu_read_GBps"] = scan->read_bytes_per_s / 1e9;
  }
  probe["cores"] = sysconf(_SC_NPROCESSORS_ONLN);
  emit(probe);

  // 2. The model and the CPU node.
  auto model = gpu_worker::DeviceModel::CreateRandom(*config, be, absl::GetFlag(FLAGS_seed));
  if (!model.ok()) {
    std::fprintf(stderr, "model: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  // Decode runs with activations sized for the largest batch only (the device memory a decode
  // server needs); the prefill runner with its --prefill_chunk activations comes afterwards.
  const std::vector<int64_t> batches = ParseList<int64_t>(absl::GetFlag(FLAGS_batches));
  gpu_worker::RunnerOptions ro;
  ro.max_chunk = std::max<int64_t>(*std::max_element(batches.begin(), batches.end()), 16);
  ro.split_min_scan_share = absl::GetFlag(FLAGS_split_min_scan_share);
  ro.split_min_scan_bytes = absl::GetFlag(FLAGS_split_min_scan_bytes);
  ro.settle_tokens_per_step = absl::GetFlag(FLAGS_settle_tokens_per_step);
  ro.speculate_pages = absl::GetFlag(FLAGS_page_speculate);
  ro.device_marks = absl::GetFlag(FLAGS_device_marks);
  auto runner = gpu_worker::ModelRunner::Create(be, **model, ro);
  if (!runner.ok()) {
    std::fprintf(stderr, "runner: %s\n", std::string(runner.status().message()).c_str());
    return 1;
  }
  const std::vector<std::string> modes = ParseList<std::string>(absl::GetFlag(FLAGS_modes));
  std::unique_ptr<gpu_worker::NodePool> pool;
  if (std::find(modes.begin(), modes.end(), "hybrid") != modes.end() ||
      std::find(modes.begin(), modes.end(), "exact") != modes.end()) {
    gpu_worker::NodePoolOptions po;
    po.embedded.pool_bytes = static_cast<uint64_t>(
        absl::GetFlag(FLAGS_host_fraction) * ProcField("/proc/meminfo", "MemAvailable"));
    po.embedded.threads = node_threads;
    po.embedded.huge_pages = absl::GetFlag(FLAGS_node_huge_pages);
    po.embedded.warm_reserve_bytes = absl::GetFlag(FLAGS_node_warm_reserve).bytes;
    po.embedded.pool_spin_us = absl::GetFlag(FLAGS_node_pool_spin_us);
    po.embedded.tasks_per_thread = absl::GetFlag(FLAGS_node_tasks_per_thread);
    po.embedded.dense_tasks_per_thread = absl::GetFlag(FLAGS_node_dense_tasks_per_thread);
    po.embedded.prefetch_entries = absl::GetFlag(FLAGS_node_prefetch_entries);
    po.embedded.shm_spin_us = absl::GetFlag(FLAGS_shm_spin_us);
    po.shm_fill_threads = absl::GetFlag(FLAGS_shm_fill_threads);
    auto node_kv_dtype = cpu_attention::ParseNodeKvDType(absl::GetFlag(FLAGS_node_kv_dtype));
    if (!node_kv_dtype.ok()) {
      std::fprintf(stderr, "--%s\n", std::string(node_kv_dtype.status().message()).c_str());
      return 2;
    }
    po.embedded.kv_dtype = *node_kv_dtype;
    po.embedded.block_tokens = static_cast<uint32_t>(std::clamp<int64_t>(absl::GetFlag(FLAGS_block), 16, 256));
    auto transport = gpu_worker::ParseNodeTransport(absl::GetFlag(FLAGS_transport));
    if (!transport.ok()) {
      std::fprintf(stderr, "%s\n", std::string(transport.status().message()).c_str());
      return 2;
    }
    po.transport = *transport;
    for (const std::string& node : ParseList<std::string>(absl::GetFlag(FLAGS_cpu_nodes))) {
      po.addresses.push_back(node);
    }
    auto p = gpu_worker::NodePool::Create(po);
    if (!p.ok()) {
      std::fprintf(stderr, "CPU node: %s\n", std::string(p.status().message()).c_str());
      return 1;
    }
    pool = std::move(*p);
  }
  Bench bench(be, **model, **runner, pool.get(), rates);
  emit({{"kind", "model"}, {"preset", absl::GetFlag(FLAGS_preset)},
        {"layers", config->num_layers}, {"hidden", config->hidden_size},
        {"weight_bytes", (*model)->weight_bytes()}, {"window", absl::GetFlag(FLAGS_window)},
        {"sink", absl::GetFlag(FLAGS_sink)}, {"transport", absl::GetFlag(FLAGS_transport)}});

  // 3. Decode, context by context.
  std::vector<bool> exact_recompute;
  for (const std::string& v : ParseList<std::string>(absl::GetFlag(FLAGS_exact_recompute))) {
    if (v != "off" && v != "auto") {
      std::fprintf(stderr, "--exact_recompute takes off and auto, got %s\n", v.c_str());
      return 2;
    }
    exact_recompute.push_back(v == "auto");
  }
  const auto shares = ParseList<double>(absl::GetFlag(FLAGS_shares));
  for (int64_t context : ParseList<int64_t>(absl::GetFlag(FLAGS_contexts))) {
    for (const std::string& name : modes) {
      auto mode = gpu_worker::ParseAttentionMode(name);
      if (!mode.ok()) {
        std::fprintf(stderr, "%s\n", std::string(mode.status().message()).c_str());
        return 2;
      }
      const std::vector<double> mode_shares =
          *mode == AttentionMode::kHybrid ? shares : std::vector<double>{0.0};
      std::vector<gpu_worker::PlacementPolicy> placements;
      for (const std::string& p : ParseList<std::string>(absl::GetFlag(FLAGS_placements))) {
        auto policy = gpu_worker::ParsePlacementPolicy(p);
        if (!policy.ok()) {
          std::fprintf(stderr, "%s\n", std::string(policy.status().message()).c_str());
          return 2;
        }
        placements.push_back(*policy);
      }
      if (*mode != AttentionMode::kHybrid) placements.resize(1);
      for (double share : mode_shares) {
        for (int64_t batch : batches) {
          for (gpu_worker::PlacementPolicy placement : placements) {
            if (*mode == AttentionMode::kExact) {
              for (const bool recompute : exact_recompute) {
                for (json& r :
                     bench.RunDecode({*mode, context, batch, share, placement, 0, recompute})) {
                  emit(r);
                }
              }
              continue;
            }
            for (json& r : bench.RunDecode({*mode, context, batch, share, placement})) emit(r);
          }
        }
      }
      if (*mode != AttentionMode::kHybrid) continue;
      for (int64_t budget : ParseList<int64_t>(absl::GetFlag(FLAGS_select_tokens))) {
        for (int64_t batch : batches) {
          for (gpu_worker::PlacementPolicy placement : placements) {
            for (json& r : bench.RunDecode({*mode, context, batch, 1.0, placement, budget})) emit(r);
          }
        }
      }
    }
  }
  // 4. TTFT, with a runner whose activations hold --prefill_chunk tokens.
  std::vector<int64_t> prefill_contexts = ParseList<int64_t>(absl::GetFlag(FLAGS_prefill_contexts));
  if (prefill_contexts.empty() && absl::GetFlag(FLAGS_prefill_tokens) > 0) {
    prefill_contexts.push_back(absl::GetFlag(FLAGS_prefill_tokens));
  }
  std::vector<gpu_worker::SelectionRule> prefill_selections;
  for (const std::string& name : ParseList<std::string>(absl::GetFlag(FLAGS_prefill_selections))) {
    if (name != "maw" && name != "pages") {
      std::fprintf(stderr, "--prefill_selections takes maw and pages, got %s\n", name.c_str());
      return 2;
    }
    prefill_selections.push_back(name == "maw" ? gpu_worker::SelectionRule::kMaw
                                               : gpu_worker::SelectionRule::kPages);
  }
  if (!prefill_contexts.empty()) {
    runner->reset();
    ro.max_chunk = absl::GetFlag(FLAGS_prefill_chunk);
    auto prefill_runner = gpu_worker::ModelRunner::Create(be, **model, ro);
    if (!prefill_runner.ok()) {
      std::fprintf(stderr, "runner: %s\n", std::string(prefill_runner.status().message()).c_str());
      return 1;
    }
    Bench prefill(be, **model, **prefill_runner, pool.get(), rates);
    // Warm-up (kernel and primitive set-up, first allocations): one chunk in gpu mode, untimed.
    (void)prefill.RunPrefill(AttentionMode::kGpu, ro.max_chunk);
    for (int64_t tokens : prefill_contexts) {
      for (const std::string& name : modes) {
        const AttentionMode mode = *gpu_worker::ParseAttentionMode(name);
        // (exact prefills as offload does, on the device with the widened window.)
        if (mode == AttentionMode::kExact) continue;
        if (mode != AttentionMode::kHybrid) {
          emit(prefill.RunPrefill(mode, tokens));
          continue;
        }
        for (gpu_worker::SelectionRule selection : prefill_selections) {
          emit(prefill.RunPrefill(mode, tokens, selection));
        }
      }
    }
  }
  PrintTable(rows);
  return 0;
}

}  // namespace
}  // namespace tandem::bench

int main(int argc, char** argv) {
  tandem::services::ParseCommandLineOrExitTwo(argc, argv);
  return tandem::bench::Main();
}
