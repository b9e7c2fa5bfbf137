// The memory estimator (issue 15 item 5; HeadInfer's Table 9 / A.4 in spirit): for a model, a
// context, a batch, an attention mode and a node set, the device, host and CPU-node memory the
// worker needs, and whether it fits. `tandem-gpu-worker --plan` prints it without loading
// weights; the Generation service's GetCapacity answers it for the live worker; the worker
// refuses at start-up a configuration whose fixed part cannot fit the device.
//
// One source of truth: every size comes from the function the allocating code uses, not from a
// second copy of its formula:
//   weights           DeviceModel::WeightBytes (Upload / CreateRandom's sum)
//   activations       ModelRunner::ActivationBytes (Create's table; + batched logits)
//   windows, gpu KV   WindowCache::BytesFor of SequenceWindowOptions (the engine's)
//   page summaries    PageIndex::BytesFor (the engine's ReservePages)
//   page selection    NodeTier::SelectionBytesFor (ChoosePages' ids and scratch)
//   offload staging   KvStreamer::DeviceBytesFor; host pages OffloadedKv::HostBytesFor
//   node KV           kv_store::BlockFormat::ShardBytes per shard (whole blocks, int8 rows
//                     with their scales, the selected copy; RemoteKv's placement uses it
//                     too), SessionMetadataBytes per session and node
// What no allocation function describes is said as such: the CUDA context and libraries
// (measured: DeviceMemoryUsed − the backend's allocations, when a backend exists), the cuda
// workspace (twice the widest bf16 GEMM input, Workspace::Reserve's growth) and cuBLAS's own
// workspace (32 MiB, its documented default on Hopper), and MAW's selected copies on the nodes
// (RemoteKvOptions::expected_selected_share of the entries, the placement's projection).
//
// Which lines a request's plan has follows the TierTraits of its mode (tier_traits.h: window or
// all positions, page summaries, where the entries live, the host streamer, the rate probe), as
// the engine's admission and sessions do; the plan never branches on the mode itself.
//
// Layout: here in serving/ because it reads the engine's options and modes and is used by the
// worker's main and the Generation service; it allocates nothing and runs on any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/engine.h"
#include "tandem/gpu_worker/model_config.h"
#include "tandem/gpu_worker/model_weights.h"
#include "tandem/gpu_worker/sequence.h"
#include "tandem/gpu_worker/tier_traits.h"
#include "tandem/gpu_worker/window_cache.h"
#include "tandem/kv_store/block_format.h"
#include "tandem/v1/generation.pb.h"

namespace tandem::gpu_worker {

// The device window of a sequence whose tier has `traits` and that plans to reach
// `planned_positions` (prompt + max_tokens, all turns so far), under the engine's `max_context`:
// an unwindowed tier (gpu mode) holds every position (rounded up to 256 so that a later turn
// often fits without Grow); the others hold sink + window. The engine opens every sequence with
// it.
WindowOptions SequenceWindowOptions(const EngineOptions& options, int64_t max_context,
                                    const TierTraits& traits, int64_t window, int64_t sink,
                                    int64_t planned_positions);

// Host bytes the prefix cache may park cached sessions in (EngineOptions::
// prefix_cache_host_bytes): the option when set, else a quarter of the host's physical memory on
// the cuda backend and 0 on the cpu backend (its device memory is host memory).
size_t ParkingBudgetBytes(const EngineOptions& options, const std::string& backend);

// The engine's KV dtype for --kv_dtype (`auto`: f32 for f32 weights, else bf16).
absl::StatusOr<DType> ResolveKvDType(const std::string& kv_dtype, DType weight_dtype);

// One CPU attention node as the plan sees it.
struct PlanNode {
  std::string address;
  uint64_t capacity_bytes = 0;  // its pool (--pool_bytes)
  uint64_t free_bytes = 0;      // free now (Stats); = capacity for a planned node
  // How it stores KV as its Stats.kv_storage reports it (int8, or the sessions' dtype as
  // sent), when the worker has its Stats; unset for a node not seen yet (a planned node, one
  // that has not answered), which the plan takes to store MemoryPlanSetup::node_kv_dtype.
  std::optional<kv_store::KvDType> kv_dtype = std::nullopt;
};

// The worker: its model, options, device and nodes.
struct MemoryPlanSetup {
  ModelConfig config;
  uint64_t weight_bytes = 0;      // DeviceModel::WeightBytes
  DType kv_dtype = DType::kBF16;  // device KV (ResolveKvDType)
  // How nodes without a reported dtype (PlanNode::kv_dtype unset) store KV: the worker's
  // --node_kv_dtype (int8), else the session's dtype as sent.
  kv_store::KvDType node_kv_dtype = kv_store::KvDType::kBf16;
  EngineOptions engine;     // chunk, block and page sizes, budgets, defaults
  int64_t max_context = 0;  // the engine's context (ModelContextLimit, --max_context)
  // Hybrid / offload prompts held whole on the device while prefilled (the window widened to
  // the prompt, WindowCache::Widen): their peak window is the prompt's.
  bool device_prefill = false;
  std::string backend = "cpu";      // "cpu" or "cuda"
  uint64_t device_total_bytes = 0;  // Backend::DeviceMemoryTotal
  // CUDA context, libraries, streams and the backend's own buffers: measured on a backend
  // (DeviceMemoryUsed − bytes_in_use before the weights, or of the live worker); 0 on cpu.
  uint64_t device_runtime_bytes = 0;
  uint64_t host_available_bytes = 0;  // MemAvailable (/proc/meminfo)
  std::vector<PlanNode> nodes;
  bool embedded_node = false;  // the node lives in the worker (its KV is host memory here)
};

// What to size: `batch` sequences of `context` positions each (prompt + generated), `prompt`
// of them the prompt (0 = all of context: the largest widened prefill), in one mode.
struct MemoryPlanRequest {
  int64_t context = 0;
  int64_t prompt = 0;
  int64_t batch = 1;
  AttentionMode mode = AttentionMode::kHybrid;
  int64_t window = 1024;
  int64_t sink = 4;
  SelectionRule selection = SelectionRule::kPages;
  PagePolicy page_policy;
  float beta = 1.0f;  // MAW selection: 0 = every entry selected (the nodes' selected copies)
  // The worker's defaults for mode, window, sink, selection and page policy.
  static MemoryPlanRequest Defaults(const EngineOptions& engine);
};

struct MemoryItem {
  std::string name;  // e.g. "weights", "kv windows"
  uint64_t bytes = 0;
  std::string detail;  // how it is made up, for people
};

// One kind of memory: its items, their total, what there is, whether it fits and, if not, why.
struct MemoryTier {
  std::string name;  // "device", "host", "nodes"
  std::vector<MemoryItem> items;
  uint64_t total_bytes = 0;
  uint64_t capacity_bytes = 0;  // 0 = none there (no node); fits then only with total 0
  bool fits = true;
  std::string why;  // "" when it fits
};

struct MemoryPlan {
  MemoryPlanRequest request;
  std::string model;  // e.g. "llama, 32 layers, 8 kv heads x 128"
  MemoryTier device, host, nodes;
  std::vector<uint64_t> node_bytes;         // per node of setup.nodes: its projected bytes
  std::vector<std::string> node_addresses;  // setup.nodes' addresses, the same order
  // setup.nodes' KV storage as planned and where it came from, the same order: e.g. "int8
  // (reported)", "bf16 (--node_kv_dtype; not seen yet)".
  std::vector<std::string> node_kv_storage;
  bool fits = false;                        // every tier fits
  int64_t largest_context = -1;  // LargestFittingContext when computed; -1 = not computed
};

// The estimate. INVALID_ARGUMENT for a request out of range (context beyond max_context, batch
// < 1, window below a block, a mode it cannot size) naming the field.
absl::StatusOr<MemoryPlan> EstimateMemory(const MemoryPlanSetup& setup,
                                          const MemoryPlanRequest& request);

// The largest context (1..max_context) whose plan fits with `request`'s batch, mode and
// generated tokens (context − prompt); 0 when none fits. Binary search (plans grow with context).
absl::StatusOr<int64_t> LargestFittingContext(const MemoryPlanSetup& setup,
                                              const MemoryPlanRequest& request);

// The fixed part of the worker on its device: weights + activations + runtime + the device KV
// budget (--kv_cache_bytes, when set). RESOURCE_EXHAUSTED naming each part and what to change
// when it exceeds the device's memory; the worker checks it before it loads weights.
absl::Status CheckWorkerFits(const MemoryPlanSetup& setup);

// The setup of a worker about to put `model` on `backend` (Engine::Create, before the weights
// go up): `model` has its config and either its mmap'ed weights or none (random weights, a
// preset: DeviceModel::WeightBytes of the config); the runtime is what the device uses beyond
// the backend's allocations now; the embedded node, when there is one, is the only node.
absl::StatusOr<MemoryPlanSetup> SetupBeforeLoad(const EngineOptions& options, const Model& model,
                                                Backend& backend);

// `tandem-gpu-worker --plan`: the setup of a worker started with `options`, from its
// config.json (or `preset`, when non-null, instead of the model directory), the weights' sizes
// (safetensors headers; nothing is loaded), a backend made as the engine makes it (device total
// and runtime measured, no weights), and its CPU nodes' Stats (remote ones are asked).
// options.quantization applies as in Engine::Create, to the preset too ("fp8": the weights'
// FP8 bytes and the cuda workspace's dequantization slab); INVALID_ARGUMENT for a bad value.
absl::StatusOr<MemoryPlanSetup> PlanSetupFromOptions(const EngineOptions& options,
                                                     const ModelConfig* preset);

// The worker's setup read from a live engine: its model, options, backend (total memory and
// runtime measured now) and its nodes' Stats (NodePool::Snapshot). Engine thread only.
absl::StatusOr<MemoryPlanSetup> SetupFromEngine(Engine& engine);

// MemAvailable of /proc/meminfo (0 when it cannot be read).
uint64_t HostAvailableBytes();

// GetCapacity (generation.proto) for a live engine: the request with the engine's defaults
// filled in, SetupFromEngine, EstimateMemory and LargestFittingContext. INVALID_ARGUMENT for a
// field out of range, naming it. Engine thread only.
absl::Status AnswerCapacity(Engine& engine, const v1::GetCapacityRequest& request,
                            v1::GetCapacityResponse* response);

// A table for people (one line per item, a verdict per tier) and the same as JSON.
std::string FormatMemoryPlan(const MemoryPlan& plan);
std::string MemoryPlanJson(const MemoryPlan& plan);

}  // namespace tandem::gpu_worker
