#include "tandem/gpu_worker/memory_plan.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "tandem/common/byte_size.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_attention/node_memory.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/exact_probe.h"
#include "tandem/gpu_worker/kv_streamer.h"
#include "tandem/gpu_worker/model_runner.h"
#include "tandem/gpu_worker/node_tier.h"
#include "tandem/gpu_worker/offloaded_kv.h"
#include "tandem/gpu_worker/page_index.h"
#include "tandem/gpu_worker/remote_kv.h"

namespace tandem::gpu_worker {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// cuBLAS's own workspace, allocated by the library on the first GEMM (not through the backend):
// its documented default on Hopper (4 MiB elsewhere; the larger is assumed).
constexpr uint64_t kCublasWorkspaceBytes = uint64_t{32} << 20;
// The node's --block_tokens default (kv_store::KvStore::Options::default_block_tokens), which a
// session gets when the worker's block size is outside the nodes' 16..256.
constexpr uint32_t kNodeDefaultBlockTokens = 64;
// The most shards a node's session holds (kv_store: 65536), which its metadata charge is
// capped at (cpu_attention_node.cc).
constexpr uint64_t kMaxShardsPerSession = 65536;

void Add(MemoryTier& tier, std::string name, uint64_t bytes, std::string detail) {
  tier.items.push_back({std::move(name), bytes, std::move(detail)});
  tier.total_bytes += bytes;
}

// Device bytes of the cuda backend's growable workspace at its largest: the widest GEMM input
// converted to the weights' 16-bit dtype ([max_chunk, max(H, Q·D, I)]), doubled because
// Workspace::Reserve grows to twice its size, rounded to its 1 MiB granule.
uint64_t CudaWorkspaceBytes(const ModelConfig& c, DType weight_dtype, int64_t max_chunk) {
  if (weight_dtype == DType::kF32) return 0;
  const int64_t widest = std::max({c.hidden_size, c.num_q_heads * c.head_dim, c.intermediate_size});
  const uint64_t convert = static_cast<uint64_t>(max_chunk) * widest * 2;
  // FP8 projections (kept FP8 on cuda): the dequantized slab beside x's bf16 copy.
  const uint64_t fp8_slab = c.quantization == "fp8" ? kCudaFp8SlabBytes : 0;
  constexpr uint64_t kGranule = uint64_t{1} << 20;
  // Workspace::Reserve grows to twice its old size: up to twice the largest request.
  return CeilDiv(2 * (convert + fp8_slab), kGranule) * kGranule;
}

// Node bytes of one shard of `entries` offloaded entries in `format`
// (kv_store::BlockFormat::ShardBytes): whole blocks (the node's pool granularity) and, for MAW
// selection, the selected copy of the selected share at its 2x bound (kv_store's
// BudgetedBuffer grows geometrically, ending between 1x and 2x the rows; a plan must fit 2x).
uint64_t ShardBytes(const kv_store::BlockFormat& format, int64_t entries, double selected_share) {
  const uint64_t selected = static_cast<uint64_t>(std::ceil(entries * selected_share));
  return format.ShardBytes(static_cast<uint64_t>(entries), selected, /*selected_growth=*/2);
}

// A node's pool bytes left after `used` (negative when overfilled).
int64_t Room(const PlanNode& node, uint64_t used) {
  return static_cast<int64_t>(node.capacity_bytes) - static_cast<int64_t>(used);
}

// How a node stores the sessions' KV when it has not reported it (and the embedded node):
// int8 when --node_kv_dtype says so, else the session's dtype as sent.
kv_store::KvDType NodeKvDType(const EngineOptions& options, DType kv_dtype) {
  return NodeStorageDType(options.nodes.embedded.kv_dtype == kv_store::KvDType::kInt8, kv_dtype);
}

const char* NodeDTypeName(kv_store::KvDType t) {
  return t == kv_store::KvDType::kF32 ? "f32" : t == kv_store::KvDType::kBf16 ? "bf16" : "int8";
}

// VmRSS of this process (0 when it cannot be read).
uint64_t SelfRssBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;  // kB
  }
  return 0;
}

std::string ModelLine(const MemoryPlanSetup& s) {
  const ModelConfig& c = s.config;
  return absl::StrCat(c.model_type, ", ", c.num_layers, " layers, hidden ", c.hidden_size, ", ",
                      c.num_q_heads, " q / ", c.num_kv_heads, " kv heads x ", c.head_dim,
                      ", vocab ", c.vocab_size, ", ", std::string(DTypeName(c.weight_dtype)),
                      " weights, ", std::string(DTypeName(s.kv_dtype)), " KV, ",
                      NodeDTypeName(s.node_kv_dtype), " node KV");
}

absl::Status ValidateRequest(const MemoryPlanSetup& setup, const MemoryPlanRequest& r) {
  if (r.context < 1 || r.context > setup.max_context) {
    return absl::InvalidArgumentError(absl::StrCat("context must be in 1..", setup.max_context,
                                                   " (the worker's max_context), got ", r.context));
  }
  if (r.prompt < 0 || r.prompt > r.context) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt must be in 0..context (", r.context, "), got ", r.prompt));
  }
  if (r.batch < 1 || r.batch > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("batch must be in 1..4096, got ", r.batch));
  }
  if (r.mode != AttentionMode::kGpu && r.mode != AttentionMode::kHybrid &&
      r.mode != AttentionMode::kOffload && r.mode != AttentionMode::kExact) {
    return absl::InvalidArgumentError(absl::StrCat(
        "no memory estimate for mode '", std::string(AttentionModeName(r.mode)), "' yet"));
  }
  if (TraitsOf(r.mode, r.selection).windowed &&
      (r.window < setup.engine.block_tokens || r.sink < 0)) {
    return absl::InvalidArgumentError(absl::StrCat("window must be >= the block size (",
                                                   setup.engine.block_tokens, ") and sink >= 0"));
  }
  if (r.page_policy.select_tokens < 1) {
    return absl::InvalidArgumentError("select_tokens must be >= 1");
  }
  return absl::OkStatus();
}

void Judge(MemoryTier& tier, const std::string& what) {
  tier.fits = tier.total_bytes <= tier.capacity_bytes;
  if (!tier.fits) {
    tier.why = absl::StrCat(what, " needs ", FormatBytes(tier.total_bytes), " but has ",
                            FormatBytes(tier.capacity_bytes));
  }
}

// The nodes' share of a plan: every sequence's L·H_kv shards, each to the node with the most
// room left after it (the placement balances memory; a node storing int8 rows takes about half
// the bytes of a bf16 one), plus each session's metadata on every node it has shards on. Each
// node's shards are sized in its own storage dtype: the one it reported, else the setup's.
void PlanNodes(const MemoryPlanSetup& setup, const MemoryPlanRequest& r, int64_t offloaded,
               const std::string& note, MemoryPlan& plan) {
  const ModelConfig& c = setup.config;
  const EngineOptions& e = setup.engine;
  MemoryTier& tier = plan.nodes;
  const uint32_t block_tokens = e.block_tokens >= 16 && e.block_tokens <= 256
                                    ? static_cast<uint32_t>(e.block_tokens)
                                    : kNodeDefaultBlockTokens;
  const bool maw = TraitsOf(r.mode, r.selection).node_selected_copies;
  const double share = !maw             ? 0.0
                       : r.beta == 0.0f ? 1.0
                                        : RemoteKvOptions{}.expected_selected_share;
  const size_t n = setup.nodes.size();
  std::vector<kv_store::BlockFormat> formats(n);
  std::vector<uint64_t> shard(n), shard_blocks(n);
  for (size_t i = 0; i < n; ++i) {
    const PlanNode& node = setup.nodes[i];
    formats[i] = {block_tokens, static_cast<uint32_t>(c.head_dim),
                  node.kv_dtype.value_or(setup.node_kv_dtype)};
    shard[i] = ShardBytes(formats[i], offloaded, share);
    shard_blocks[i] = ShardBytes(formats[i], offloaded, 0.0);
    plan.node_addresses.push_back(node.address);
    plan.node_kv_storage.push_back(absl::StrCat(
        NodeDTypeName(formats[i].dtype),
        node.kv_dtype.has_value() ? " (reported)" : " (--node_kv_dtype; not seen yet)"));
  }
  const uint64_t shards_per_seq = static_cast<uint64_t>(c.num_layers) * c.num_kv_heads;
  plan.node_bytes.assign(n, 0);
  for (const PlanNode& node : setup.nodes) tier.capacity_bytes += node.capacity_bytes;
  if (n == 0) {
    tier.fits = false;
    tier.why = "hybrid and exact modes need CPU attention nodes and there are none";
    return;
  }
  std::vector<uint64_t> mine(n), placed(n, 0);
  uint64_t meta_bytes = 0;
  for (int64_t b = 0; b < r.batch; ++b) {
    std::fill(mine.begin(), mine.end(), 0);
    for (uint64_t s = 0; s < shards_per_seq; ++s) {
      size_t best = 0;
      for (size_t i = 1; i < n; ++i) {
        if (Room(setup.nodes[i], plan.node_bytes[i] + shard[i]) >
            Room(setup.nodes[best], plan.node_bytes[best] + shard[best])) {
          best = i;
        }
      }
      plan.node_bytes[best] += shard[best];
      ++mine[best];
      ++placed[best];
    }
    for (size_t i = 0; i < n; ++i) {
      if (mine[i] == 0) continue;
      const uint64_t meta = cpu_attention::SessionMetadataBytes(
          c.num_layers, std::min(mine[i], kMaxShardsPerSession));
      plan.node_bytes[i] += meta;
      meta_bytes += meta;
    }
  }
  // One line per storage dtype among the nodes that got shards.
  uint64_t blocks_bytes = 0, selected_bytes = 0;
  std::string blocks_detail;
  for (kv_store::KvDType dtype :
       {kv_store::KvDType::kF32, kv_store::KvDType::kBf16, kv_store::KvDType::kInt8}) {
    uint64_t shards = 0;
    size_t of = n;
    for (size_t i = 0; i < n; ++i) {
      if (formats[i].dtype != dtype || placed[i] == 0) continue;
      shards += placed[i];
      blocks_bytes += placed[i] * shard_blocks[i];
      selected_bytes += placed[i] * (shard[i] - shard_blocks[i]);
      of = i;
    }
    if (shards == 0) continue;
    const kv_store::BlockFormat& f = formats[of];
    absl::StrAppend(&blocks_detail, blocks_detail.empty() ? "" : "; ", shards, " shards x ",
                    CeilDiv(offloaded, f.block_tokens), " blocks x ", f.block_bytes(), " B (",
                    f.block_tokens, " ", NodeDTypeName(dtype), " entries of K, V and MAW)");
  }
  Add(tier, "node KV blocks", blocks_bytes, absl::StrCat(blocks_detail, note));
  if (maw) {
    Add(tier, "node selected copies", selected_bytes,
        absl::StrCat("K + V of ", share * 100, "% of the entries (",
                     r.beta == 0.0f ? "beta 0: all" : "the placement's projection",
                     "), up to 2x for geometric growth"));
  }
  Add(tier, "node session metadata", meta_bytes,
      absl::StrCat(r.batch, " session(s) on up to ", n, " node(s), SessionMetadataBytes"));
  tier.fits = true;
  for (size_t i = 0; i < n; ++i) {
    if (plan.node_bytes[i] > setup.nodes[i].capacity_bytes) {
      tier.fits = false;
      tier.why = absl::StrCat(
          "CPU node ", setup.nodes[i].address, " would need ", FormatBytes(plan.node_bytes[i]),
          " but its pool has ", FormatBytes(setup.nodes[i].capacity_bytes),
          ": add nodes or --pool_bytes, use a shorter context or batch",
          formats[i].dtype == kv_store::KvDType::kInt8 ? "" : ", or int8 node KV");
      break;
    }
  }
}

// A node of the pool as the plan sees it: its storage dtype is the reported one once it has
// answered Stats (a node id is set), as NodePool::ApplyStatsLocked reads Stats.kv_storage:
// "int8", else the session's `kv_dtype` as sent.
PlanNode PlanNodeOf(const NodeState& node, DType kv_dtype) {
  PlanNode p{node.address, node.capacity_bytes, node.free_bytes, std::nullopt};
  if (!node.node_id.empty()) {
    p.kv_dtype = NodeStorageDType(node.int8_kv, kv_dtype);
  }
  return p;
}

}  // namespace

WindowOptions SequenceWindowOptions(const EngineOptions& options, int64_t max_context,
                                    const TierTraits& traits, int64_t window, int64_t sink,
                                    int64_t planned_positions) {
  WindowOptions wo;
  wo.block = options.block_tokens;
  wo.max_chunk = options.prefill_chunk;
  wo.max_context = max_context;
  if (!traits.windowed) {
    constexpr int64_t kGranule = 256;
    wo.window = WindowOptions::kUnlimited;
    wo.sink = 0;
    wo.max_context = std::min(max_context, CeilDiv(planned_positions, kGranule) * kGranule);
  } else {
    wo.window = window;
    wo.sink = sink;
  }
  return wo;
}

absl::StatusOr<DType> ResolveKvDType(const std::string& kv_dtype, DType weight_dtype) {
  if (kv_dtype == "auto") return weight_dtype == DType::kF32 ? DType::kF32 : DType::kBF16;
  if (kv_dtype == "bf16") return DType::kBF16;
  if (kv_dtype == "f32") return DType::kF32;
  return absl::InvalidArgumentError(
      absl::StrCat("kv_dtype must be auto, bf16 or f32, got '", kv_dtype, "'"));
}

MemoryPlanRequest MemoryPlanRequest::Defaults(const EngineOptions& e) {
  MemoryPlanRequest r;
  r.mode = e.default_mode;
  r.window = e.default_window;
  r.sink = e.default_sink;
  r.selection = e.default_selection;
  r.page_policy = e.default_page_policy;
  r.beta = e.default_beta;
  return r;
}

size_t ParkingBudgetBytes(const EngineOptions& options, const std::string& backend) {
  if (options.prefix_cache_host_bytes.has_value()) return *options.prefix_cache_host_bytes;
  const long pages = sysconf(_SC_PHYS_PAGES), page_bytes = sysconf(_SC_PAGESIZE);
  if (backend != "cuda" || pages <= 0 || page_bytes <= 0) return 0;
  return static_cast<size_t>(pages) * static_cast<size_t>(page_bytes) / 4;
}

absl::StatusOr<MemoryPlan> EstimateMemory(const MemoryPlanSetup& setup,
                                          const MemoryPlanRequest& r) {
  TANDEM_RETURN_IF_ERROR(ValidateRequest(setup, r));
  const ModelConfig& c = setup.config;
  const EngineOptions& e = setup.engine;
  const int64_t C = e.prefill_chunk;
  const WindowGeometry geometry{c.num_layers, c.num_kv_heads, c.head_dim, setup.kv_dtype};
  const TierTraits traits = TraitsOf(r.mode, r.selection);
  const bool offloads = traits.windowed;
  const int64_t prompt = r.prompt > 0 ? r.prompt : r.context;
  const int64_t offloaded = offloads ? std::max<int64_t>(0, r.context - r.window - r.sink) : 0;
  MemoryPlan plan;
  plan.request = r;
  plan.model = ModelLine(setup);
  plan.device.name = "device";
  plan.host.name = "host";
  plan.nodes.name = "nodes";

  // --- Device.
  MemoryTier& dev = plan.device;
  Add(dev, "weights", setup.weight_bytes, "DeviceModel::WeightBytes");
  Add(dev, "activations", ModelRunner::ActivationBytes(c, EngineRunnerOptions(e), r.batch > 1),
      absl::StrCat(C, "-token chunk", r.batch > 1 ? ", batched logits" : ""));
  const WindowOptions wo =
      SequenceWindowOptions(e, setup.max_context, traits, r.window, r.sink, r.context);
  uint64_t device_kv = WindowCache::BytesFor(geometry, wo) * r.batch;
  Add(dev, traits.windowed ? "kv windows" : "kv (all on the device)", device_kv,
      absl::StrCat(r.batch, " x ",
                   traits.windowed
                       ? absl::StrCat("sink ", r.sink, " + window ", r.window, " + one chunk")
                       : absl::StrCat("all ", wo.max_context, " positions")));
  // Buffers only decode steps use (made after the prompt is in). A widened prefill's window
  // meets them only while its settle goes a slice per decode step (settle_tokens_per_step > 0,
  // the default): then both count; settled all at once, the two phases' extras do not add up.
  const bool settle_at_once = e.settle_tokens_per_step == 0;
  uint64_t decode_only = 0;
  const uint64_t summaries =
      PageSummaryBytesFor(traits, geometry, e.page_tokens, offloaded, e.page_low_rank) * r.batch;
  if (traits.page_summaries) {
    Add(dev, "page summaries", summaries,
        absl::StrCat(r.batch, " x ", CeilDiv(offloaded, e.page_tokens), " pages of ", e.page_tokens,
                     " tokens (min/max/mean keys",
                     e.page_low_rank.enabled()
                         ? absl::StrCat(", rank-", e.page_low_rank.RankFor(c.head_dim),
                                        " key coordinates")
                         : std::string(),
                     ")"));
    const int64_t num_pages = CeilDiv(offloaded, e.page_tokens);
    const int64_t per_head = std::max<int64_t>(1, r.page_policy.select_tokens / e.page_tokens);
    if (per_head < num_pages) {
      // A prefill chunk's selection over the tier (the last chunk sees every page); with the
      // device prefill a new prompt's chunks attend on the device and only decode rows select.
      const int64_t rows = setup.device_prefill ? 1 : C;
      const uint64_t bytes =
          NodeTier::SelectionBytesFor(rows, c.num_kv_heads, num_pages, per_head) * r.batch;
      Add(dev, "page selection", bytes,
          absl::StrCat(rows, " query rows x ", num_pages, " pages, ", per_head, " chosen"));
      decode_only += setup.device_prefill && settle_at_once ? bytes : 0;
    }
  }
  // The runner's page streamer (HostPageStreams::Of): made when a streaming tier's
  // session opens, and before a spilling tier's prompt beyond the window widens it (the prefill
  // spill streams through it), so it is held beside a widened prefill too: never decode-only.
  const bool host_streams = traits.streams_host_pages ||
                            (traits.spills_prefill && setup.device_prefill && prompt > r.window);
  if (host_streams) {
    const uint64_t bytes =
        KvStreamer::DeviceBytesFor(geometry, e.offload_page_tokens, c.num_q_heads, C);
    Add(dev, "offload staging", bytes,
        absl::StrCat("2 upload slots of ", e.offload_page_tokens, "-token pages"));
  }
  // The runner's page-locked staging of evicted blocks (TierContext::ReadEvicted), made at the
  // first eviction and kept: backend memory on cpu (AllocateHost = Allocate), host on cuda.
  const uint64_t evict_staging =
      offloads && offloaded > 0 ? TierContext::EvictStagingBytes(geometry, e.block_tokens) : 0;
  const std::string evict_note = absl::StrCat(
      "K and V of up to ", std::max(TierContext::kEvictGroupTokens, e.block_tokens),
      " evicted tokens of one layer");
  if (evict_staging > 0 && setup.backend == "cpu") {
    Add(dev, "eviction staging", evict_staging, evict_note);
  }
  if (traits.measures_rates) {
    // ExactRateBook::Measure at the engine's first exact session: transient.
    const ExactGeometry g{c.num_layers,
                          c.num_kv_heads,
                          c.head_dim,
                          c.hidden_size,
                          DTypeBytes(setup.kv_dtype),
                          DTypeBytes(setup.kv_dtype)};
    // The probe's buffers are gone before the first eviction makes the staging (cpu: device
    // memory too), so the peak holds the larger of the two: the probe counts above the staging.
    const uint64_t probe =
        ProbeDeviceBytes(g, setup.kv_dtype, /*host_is_device=*/setup.backend == "cpu");
    const uint64_t staging_on_device = setup.backend == "cpu" ? evict_staging : 0;
    Add(dev, "exact rate probe", probe > staging_on_device ? probe - staging_on_device : 0,
        "PCIe, attention and GEMM probes at the first exact session, one at a time, freed before "
        "the eviction staging is made (the part above it)");
  }
  if (setup.backend == "cuda") {
    Add(dev, "cuda runtime", setup.device_runtime_bytes,
        "context, streams, staging (measured on the device)");
    Add(dev, "cuda workspace", CudaWorkspaceBytes(c, c.weight_dtype, C) + kCublasWorkspaceBytes,
        "2 x the widest bf16 GEMM input (+ 32 MiB of dequantized FP8 rows) + cuBLAS's 32 MiB");
  }
  int64_t spilled = 0;  // prompt tokens per sequence a partly widened hybrid prefill spills
  if (setup.device_prefill && offloads && prompt > r.window) {
    // WindowCache::Widen(prompt): Create's rule with window = prompt. Widen and the shrink
    // after Narrow re-lay the ring into new buffers, so for a moment the widened ring and the
    // configured one (above) both exist. The engine widens only as far as the free part of
    // --kv_cache_bytes and the device allow (the rest of the prompt then attends through the
    // tier): so does the plan.
    WindowOptions widened = wo;
    widened.window = prompt;
    const uint64_t full = WindowCache::BytesFor(geometry, widened) * r.batch;
    uint64_t bytes = full;
    if (e.kv_cache_bytes > 0) {
      const uint64_t used = device_kv + summaries;
      bytes = std::min(bytes, e.kv_cache_bytes > used ? e.kv_cache_bytes - used : 0);
    }
    // Decode-only buffers are not there yet while the prompt is prefilled: a widening settled
    // at once may use them (decode_only is 0 when the settle goes in slices).
    const uint64_t others = dev.total_bytes - decode_only;
    if (setup.device_total_bytes > 0) {
      bytes = std::min(bytes,
                       setup.device_total_bytes > others ? setup.device_total_bytes - others : 0);
    }
    Add(dev, "widened prefill windows", bytes > decode_only ? bytes - decode_only : 0,
        absl::StrCat(r.batch, " x the window widened to the ", prompt,
                     "-token prompt while it is prefilled",
                     bytes < full ? absl::StrCat(" (", 100 * bytes / full, "% of it fits)") : "",
                     decode_only > 0 ? ", less the decode-only buffers" : ""));
    if (bytes < full && traits.spills_prefill) {
      // A hybrid prompt beyond the widened window spills (PrefillSpillTier): the blocks that
      // leave during the prefill are also kept in pinned host pages, attended from there on
      // the device, until the first token. The widest window within `bytes`:
      int64_t lo = r.window, hi = prompt;
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        widened.window = mid;
        (WindowCache::BytesFor(geometry, widened) * r.batch <= bytes ? lo : hi) = mid;
      }
      spilled = std::max<int64_t>(0, prompt - lo - r.sink);
    }
  }
  dev.capacity_bytes = setup.device_total_bytes;
  Judge(dev, absl::StrCat("the device (", setup.backend, ")"));
  if (dev.fits && e.kv_cache_bytes > 0 && device_kv + summaries > e.kv_cache_bytes) {
    dev.fits = false;
    dev.why = absl::StrCat("device KV (windows and page summaries) needs ",
                           FormatBytes(device_kv + summaries), " but --kv_cache_bytes is ",
                           FormatBytes(e.kv_cache_bytes));
  }
  if (dev.fits && e.page_summary_bytes > 0 && summaries > e.page_summary_bytes) {
    dev.fits = false;
    dev.why = absl::StrCat("page summaries need ", FormatBytes(summaries),
                           " but --page_summary_bytes is ", FormatBytes(e.page_summary_bytes));
  }

  // --- CPU nodes (hybrid; exact: the entries the planner leaves to them).
  // A split tier (exact) splits at run time from measured rates unless --exact_fetch_share
  // forces it; unforced, each side is sized for all of the entries, the most it may be given.
  const double fetch = e.exact_fetch_share >= 0 ? std::min(e.exact_fetch_share, 1.0) : -1.0;
  const EntrySplit entries = SplitEntries(traits, offloaded, fetch);
  // What a split plan assumes, per side.
  auto split_note = [&](double share) -> std::string {
    if (!(traits.entries_on_host && traits.entries_on_nodes)) return "";
    if (fetch < 0) return "; exact: at most, the planner splits at run time";
    return absl::StrCat("; exact: ", share * 100, "% of them");
  };
  const bool uses_nodes = traits.entries_on_nodes;
  if (uses_nodes) PlanNodes(setup, r, entries.nodes, split_note(1 - fetch), plan);

  // --- Host.
  MemoryTier& host = plan.host;
  if (traits.entries_on_host) {
    Add(host, "pinned KV pages",
        OffloadedKv::HostBytesFor(geometry, e.offload_page_tokens, entries.host) * r.batch,
        absl::StrCat(r.batch, " x ", entries.host, " offloaded tokens in ", e.offload_page_tokens,
                     "-token pages", split_note(fetch)));
  }
  if (spilled > 0) {
    Add(host, "prefill spill pages",
        OffloadedKv::HostBytesFor(geometry, e.offload_page_tokens, spilled) * r.batch,
        absl::StrCat(r.batch, " x ", spilled,
                     " prompt tokens beyond the widened window, until the first token"));
  }
  if (evict_staging > 0 && setup.backend != "cpu") {
    Add(host, "eviction staging", evict_staging, evict_note);
  }
  // The runner's host staging of q, o and lse (model_runner.cc Create).
  Add(host, "staging", static_cast<uint64_t>(C) * c.num_q_heads * (2 * c.head_dim + 1) * 4,
      "q, o and lse of one chunk");
  if (setup.embedded_node && uses_nodes) {
    Add(host, "embedded node KV", plan.nodes.total_bytes, "the in-process CPU node's pool");
    // Free blocks kept faulted in beside the sessions' (kv_store::BlockWarmer): resident while
    // any session holds blocks, at most what the pool's budget could still hand out.
    const uint64_t pool = e.nodes.embedded.pool_bytes;
    const uint64_t reserve = std::min<uint64_t>(
        e.nodes.embedded.warm_reserve_bytes,
        pool > plan.nodes.total_bytes ? pool - plan.nodes.total_bytes : 0);
    if (reserve > 0) {
      Add(host, "embedded node warm reserve", reserve,
          "free KV blocks the in-process node keeps faulted in while sessions hold blocks "
          "(--node_warm_reserve)");
    }
  }
  if (setup.backend == "cpu") {
    Add(host, "device memory (cpu backend)", dev.total_bytes, "the cpu backend computes in RAM");
  }
  if (const size_t parking = e.prefix_cache ? ParkingBudgetBytes(e, setup.backend) : 0;
      parking > 0) {
    Add(host, "parked cached sessions", parking,
        "at most --prefix_cache_host_bytes, pinned as the prefix cache first parks sessions "
        "there and kept");
  }
  host.capacity_bytes = setup.host_available_bytes;
  Judge(host, "host memory");
  plan.fits = dev.fits && host.fits && plan.nodes.fits;
  return plan;
}

absl::StatusOr<int64_t> LargestFittingContext(const MemoryPlanSetup& setup,
                                              const MemoryPlanRequest& request) {
  const int64_t generated = request.prompt > 0 ? request.context - request.prompt : 0;
  auto fits = [&](int64_t context) -> absl::StatusOr<bool> {
    MemoryPlanRequest r = request;
    r.context = context;
    r.prompt = request.prompt > 0 ? std::max<int64_t>(1, context - generated) : 0;
    TANDEM_ASSIGN_OR_RETURN(const MemoryPlan plan, EstimateMemory(setup, r));
    return plan.fits;
  };
  int64_t lo = 0, hi = setup.max_context;  // fits(lo) (or lo = 0), !fits(hi + 1)
  TANDEM_ASSIGN_OR_RETURN(const bool all, fits(hi));
  if (all) return hi;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    TANDEM_ASSIGN_OR_RETURN(const bool ok, fits(mid));
    (ok ? lo : hi) = mid;
  }
  return lo;
}

absl::Status CheckWorkerFits(const MemoryPlanSetup& setup) {
  const ModelConfig& c = setup.config;
  const RunnerOptions runner = EngineRunnerOptions(setup.engine);
  const uint64_t activations = ModelRunner::ActivationBytes(c, runner, /*batched=*/true);
  const uint64_t workspace =
      setup.backend == "cuda"
          ? CudaWorkspaceBytes(c, c.weight_dtype, runner.max_chunk) + kCublasWorkspaceBytes
          : 0;
  const uint64_t fixed = setup.weight_bytes + activations + setup.device_runtime_bytes + workspace;
  const uint64_t kv = setup.engine.kv_cache_bytes;
  if (fixed + kv <= setup.device_total_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the device has ", FormatBytes(setup.device_total_bytes), " but the worker needs ",
      FormatBytes(fixed + kv), ": weights ", FormatBytes(setup.weight_bytes), ", activations ",
      FormatBytes(activations), " (--prefill_chunk ", runner.max_chunk, "), runtime and workspace ",
      FormatBytes(setup.device_runtime_bytes + workspace),
      kv > 0 ? absl::StrCat(", --kv_cache_bytes ", FormatBytes(kv)) : "",
      ": use a smaller --kv_cache_bytes or --prefill_chunk, or a larger device "
      "(tandem-gpu-worker --plan shows the whole estimate)"));
}

uint64_t HostAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t value = 0;
  std::string unit;
  while (in >> key >> value) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return value * 1024;  // kB
  }
  return 0;
}

absl::StatusOr<MemoryPlanSetup> SetupBeforeLoad(const EngineOptions& options, const Model& model,
                                                Backend& backend) {
  MemoryPlanSetup s;
  s.config = model.config;
  if (options.random_weights || model.archive == nullptr) {
    TANDEM_ASSIGN_OR_RETURN(s.weight_bytes, DeviceModel::WeightBytes(model.config));
  } else {
    s.weight_bytes = DeviceModel::WeightBytes(model.weights, backend);
  }
  TANDEM_ASSIGN_OR_RETURN(s.kv_dtype, ResolveKvDType(options.kv_dtype, model.weights.dtype));
  s.node_kv_dtype = NodeKvDType(options, s.kv_dtype);
  s.engine = options;
  s.max_context = ModelContextLimit(model.config);
  if (options.max_context > 0) s.max_context = std::min(s.max_context, options.max_context);
  s.device_prefill = options.device_prefill;
  s.backend = std::string(backend.name());
  TANDEM_ASSIGN_OR_RETURN(s.device_total_bytes, backend.DeviceMemoryTotal());
  if (s.backend == "cuda") {
    TANDEM_ASSIGN_OR_RETURN(const size_t used, backend.DeviceMemoryUsed());
    s.device_runtime_bytes = used > backend.bytes_in_use() ? used - backend.bytes_in_use() : 0;
  }
  s.host_available_bytes = HostAvailableBytes();
  s.embedded_node =
      options.nodes.addresses.empty() && options.nodes.dns_name.empty() && !options.nodes.discovery;
  if (s.embedded_node) {
    // Its storage is the worker's own --node_kv_dtype: known, as if reported.
    s.nodes.push_back({"in-process", options.nodes.embedded.pool_bytes,
                       options.nodes.embedded.pool_bytes, s.node_kv_dtype});
  }
  return s;
}

absl::StatusOr<MemoryPlanSetup> PlanSetupFromOptions(const EngineOptions& options,
                                                     const ModelConfig* preset) {
  Model model;
  std::unique_ptr<Model> loaded;
  const Model* use = &model;
  if (preset != nullptr) {
    model.config = *preset;
  } else if (options.random_weights) {
    TANDEM_ASSIGN_OR_RETURN(model.config, LoadModelConfig(options.model_dir));
  } else {
    // Headers only, the weights mmap'ed; --quantization as Engine::Create loads it.
    TANDEM_ASSIGN_OR_RETURN(loaded,
                            LoadModel(options.model_dir, {.quantization = options.quantization}));
    use = loaded.get();
  }
  if (use == &model) {
    // A preset or random geometry: --quantization fp8 makes its weights FP8 (WeightBytes(config)).
    TANDEM_RETURN_IF_ERROR(ApplyQuantizationOption(options.quantization, &model.config));
    model.weights.dtype = model.config.weight_dtype;
  }
  // The backend as Engine::Create makes it: cuda when usable (for "auto"), else cpu.
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      options.backend == "cpu" ? CreateCpuBackend(1) : CreateCudaBackend(options.cuda_device);
  if (!backend.ok() && options.backend == "auto") backend = CreateCpuBackend(1);
  if (!backend.ok()) return backend.status();
  TANDEM_ASSIGN_OR_RETURN(MemoryPlanSetup s, SetupBeforeLoad(options, *use, **backend));
  if (!s.embedded_node) {
    TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<NodePool> pool, NodePool::Create(options.nodes));
    for (const NodeState& node : pool->Snapshot()) s.nodes.push_back(PlanNodeOf(node, s.kv_dtype));
  }
  return s;
}

absl::StatusOr<MemoryPlanSetup> SetupFromEngine(Engine& engine) {
  MemoryPlanSetup s;
  const ModelInfo info = engine.info();
  s.config = engine.model().config;
  s.weight_bytes = info.weight_bytes;
  TANDEM_ASSIGN_OR_RETURN(s.kv_dtype, ResolveKvDType(info.kv_dtype, DType::kF32));
  s.engine = engine.options();
  s.node_kv_dtype = NodeKvDType(s.engine, s.kv_dtype);
  s.max_context = info.max_context;
  s.device_prefill = s.engine.device_prefill;
  Backend& backend = engine.backend();
  s.backend = std::string(backend.name());
  TANDEM_ASSIGN_OR_RETURN(s.device_total_bytes, backend.DeviceMemoryTotal());
  if (s.backend == "cuda") {
    // Everything on the device that is not the backend's allocations: context, libraries, the
    // workspace as it has grown by now (so the workspace line double-counts it, on the safe side).
    TANDEM_ASSIGN_OR_RETURN(const size_t used, backend.DeviceMemoryUsed());
    s.device_runtime_bytes = used > backend.bytes_in_use() ? used - backend.bytes_in_use() : 0;
  }
  // What this worker holds now (its pinned pages, embedded node, cpu-backend buffers) is not in
  // MemAvailable: the worker may have what is available plus what it holds.
  s.host_available_bytes = HostAvailableBytes() + SelfRssBytes();
  for (const NodeState& node : engine.nodes().Snapshot()) {
    s.nodes.push_back(PlanNodeOf(node, s.kv_dtype));
  }
  s.embedded_node = engine.nodes().embedded() != nullptr;
  return s;
}

}  // namespace tandem::gpu_worker
