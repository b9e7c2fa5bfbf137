#include "synthetic_context.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/common/bf16.h"
#include "tandem/common/status_macros.h"
#include "tandem/gpu_worker/exact_tier.h"
#include "tandem/gpu_worker/random_values.h"
#include "tandem/gpu_worker/tier_factory.h"

namespace tandem::bench {
namespace {

using gpu_worker::AttentionMode;
using gpu_worker::Backend;
using gpu_worker::DType;
using gpu_worker::Sequence;
using gpu_worker::WindowCache;

int64_t CeilTo(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// Appends `count` positions to the window in passes of at most max_chunk (no forward pass: the
// window's K/V are already random).
absl::Status AppendPositions(WindowCache& window, int64_t count, int64_t max_chunk) {
  for (int64_t done = 0; done < count;) {
    const int64_t n = std::min(max_chunk, count - done);
    TANDEM_RETURN_IF_ERROR(window.Append(n).status());
    done += n;
  }
  return absl::OkStatus();
}

// Offloaded entries for the CPU nodes: K/V rows taken from a random pool at varying offsets,
// MAW drawn as maw = u · threshold / (1 - share) with u uniform in [0, 1), so that
// P(maw > threshold) = share exactly in distribution.
absl::Status FillRemote(gpu_worker::RemoteKv& remote, const gpu_worker::ModelConfig& c,
                        const SyntheticContextOptions& o, int64_t offloaded) {
  const int64_t Hkv = c.num_kv_heads, D = c.head_dim;
  const int64_t chunk = std::min<int64_t>(o.append_tokens, std::max<int64_t>(offloaded, 1));
  const int64_t pool_rows = Hkv * chunk + 4099;   // odd-sized so offsets move through it
  std::vector<bf16_t> pool(static_cast<size_t>(pool_rows) * D);
  for (size_t i = 0; i < pool.size(); ++i) {
    pool[i] = FloatToBf16(gpu_worker::RandomSigned(o.seed, i, 1.0f));
  }
  const int64_t window_entries = o.sink + o.window;
  const double threshold = o.beta / static_cast<double>(window_entries);
  auto scale_of = [&](int64_t layer, int64_t head) {
    const double share = o.head_shares.empty() ? o.share : o.head_shares[layer * Hkv + head];
    return threshold / std::max(1.0 - share, 1e-9);
  };
  std::vector<float> maw(Hkv * chunk);
  uint64_t call = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    for (int64_t done = 0; done < offloaded; done += chunk, ++call) {
      const int64_t n = std::min(chunk, offloaded - done);
      const int64_t k_row = static_cast<int64_t>((call * 7919) % 4099);
      const int64_t v_row = static_cast<int64_t>((call * 104729 + 2048) % 4099);
      for (int64_t h = 0; h < Hkv; ++h) {
        const double scale = scale_of(l, h);
        for (int64_t i = h * n; i < (h + 1) * n; ++i) {
          const float u = 0.5f * (gpu_worker::RandomSigned(o.seed + 1 + call, i, 1.0f) + 1.0f);
          maw[i] = static_cast<float>(u * scale);
        }
      }
      // Rows [k_row, k_row + Hkv·n) of the pool are [Hkv, n, D] head-major.
      TANDEM_RETURN_IF_ERROR(remote.Append(l, pool.data() + k_row * D, pool.data() + v_row * D,
                                           maw.data(), n, window_entries));
    }
  }
  return absl::OkStatus();
}

// Page summaries of `offloaded` entries per (layer, kv head), summarised from a random K buffer
// (the values only steer which pages win; the cost depends on the page count and budget).
absl::Status FillPageIndex(Backend& backend, const gpu_worker::ModelConfig& c,
                           const SyntheticContextOptions& o, int64_t offloaded,
                           gpu_worker::PageIndex& index) {
  const int64_t capacity = std::min<int64_t>(CeilTo(offloaded, o.block), 65536);
  const size_t count = static_cast<size_t>(c.num_kv_heads) * capacity * c.head_dim;
  TANDEM_ASSIGN_OR_RETURN(gpu_worker::DeviceBuffer k, backend.Allocate(count * 2));
  TANDEM_RETURN_IF_ERROR(backend.RandomFill({k.data(), DType::kBF16, count, o.seed + 21, 1.0f}));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    for (int64_t done = 0; done < offloaded;) {
      const int64_t n = std::min(capacity, offloaded - done);
      // Varying start slots so layers and chunks get different summaries.
      const int64_t first = ((l * 7 + done / capacity) * o.block) % (capacity - n + 1);
      TANDEM_RETURN_IF_ERROR(index.Append(l, k.data(), capacity, first - first % o.block, n));
      done += n;
    }
  }
  return backend.Synchronize();
}

absl::Status FillHostPages(Backend& backend, gpu_worker::OffloadedKv& kv,
                           const gpu_worker::ModelConfig& c,
                           const SyntheticContextOptions& o, int64_t offloaded) {
  const int64_t Hkv = c.num_kv_heads, D = c.head_dim;
  const int64_t chunk = std::min(o.page_tokens, std::max<int64_t>(offloaded, 1));
  const size_t count = static_cast<size_t>(Hkv * chunk * D);
  TANDEM_ASSIGN_OR_RETURN(gpu_worker::DeviceBuffer k, backend.Allocate(count * 2));
  TANDEM_ASSIGN_OR_RETURN(gpu_worker::DeviceBuffer v, backend.Allocate(count * 2));
  TANDEM_RETURN_IF_ERROR(backend.RandomFill({k.data(), DType::kBF16, count, o.seed + 11, 1.0f}));
  TANDEM_RETURN_IF_ERROR(backend.RandomFill({v.data(), DType::kBF16, count, o.seed + 12, 1.0f}));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    for (int64_t done = 0; done < offloaded; done += chunk) {
      const int64_t n = std::min(chunk, offloaded - done);
      TANDEM_RETURN_IF_ERROR(kv.AppendFromDevice(l, k.data(), v.data(), n));
    }
  }
  return backend.Synchronize();
}

// A node session over the bench's bf16 K/V (hybrid, exact): the model's geometry, blocks of
// o.block clamped to the node's 16..256, generous deadlines, no re-planning in the timed steps
// (the bench re-plans explicitly); the caller sets the tokens it expects and the selection.
gpu_worker::RemoteKvOptions NodeSessionOptions(const gpu_worker::ModelConfig& c,
                                               const SyntheticContextOptions& o,
                                               const std::string& id) {
  gpu_worker::RemoteKvOptions ro;
  ro.session_id = id;
  ro.num_layers = c.num_layers;
  ro.num_q_heads = c.num_q_heads;
  ro.num_kv_heads = c.num_kv_heads;
  ro.head_dim = c.head_dim;
  ro.kv_dtype = DType::kBF16;
  ro.block_tokens = static_cast<uint32_t>(std::clamp<int64_t>(o.block, 16, 256));
  ro.attend_deadline_ms = 10000;
  ro.control_deadline_ms = 600000;
  ro.placement = o.placement;
  ro.pool_rates_by_threads = o.pool_node_rates;
  ro.shm_spin_us = o.shm_spin_us;
  ro.replan_every_steps = 0;
  return ro;
}

// The exact tier of `offloaded` entries per (layer, kv head): the planned (or forced) host
// share in host pages, whole blocks, the rest appended to a pages session on the nodes.
absl::StatusOr<std::unique_ptr<gpu_worker::OffloadTier>> MakeExactTier(
    Backend& backend, const gpu_worker::ModelConfig& c, gpu_worker::NodePool& pool,
    const std::string& id, const SyntheticContextOptions& o, int64_t offloaded) {
  if (o.exact_rates == nullptr) return absl::InvalidArgumentError("exact: no rates to plan with");
  gpu_worker::ExactTierOptions eo;
  eo.geometry = {c.num_layers, c.num_kv_heads, c.head_dim, c.hidden_size, 2, 2};
  eo.expected_tokens = offloaded + o.extra_positions;
  eo.plan.force_fetch_share = o.exact_fetch_share;
  eo.plan.allow_recompute = o.exact_recompute && o.model != nullptr;
  eo.model = o.model;
  if (eo.plan.allow_recompute) eo.plan.force_recompute_share = o.exact_recompute_share;
  eo.replan_every_steps = 0;   // the plan of the start stays (the bench times it)
  const gpu_worker::ExactPlan plan =
      gpu_worker::PlanExactSplit(o.exact_rates->rates(), eo.geometry, offloaded, eo.plan);
  // Whole blocks: recomputed first, then fetched, the rest on the nodes.
  const int64_t rec = std::min(
      offloaded,
      CeilTo(static_cast<int64_t>(std::llround(plan.recompute_share * offloaded)), o.block));
  const int64_t host = std::min(
      offloaded - rec,
      CeilTo(static_cast<int64_t>(std::llround(plan.fetch_share * offloaded)), o.block));
  gpu_worker::RemoteKvOptions ro = NodeSessionOptions(c, o, id);
  ro.expected_tokens = offloaded - rec - host + o.extra_positions;
  ro.selection = gpu_worker::SelectionRule::kPages;
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<gpu_worker::RemoteKv> remote,
                          gpu_worker::RemoteKv::Open(pool, ro));
  if (offloaded > rec + host) {
    TANDEM_RETURN_IF_ERROR(FillRemote(*remote, c, o, offloaded - rec - host));
  }
  const gpu_worker::WindowGeometry geometry{c.num_layers, c.num_kv_heads, c.head_dim,
                                            DType::kBF16};
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<gpu_worker::OffloadedKv> kv,
                          gpu_worker::OffloadedKv::Create(backend, geometry, o.page_tokens));
  if (host > 0) TANDEM_RETURN_IF_ERROR(FillHostPages(backend, *kv, c, o, host));
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<gpu_worker::ExactTier> tier,
                          gpu_worker::ExactTier::Create(std::move(kv), std::move(remote),
                                                        o.exact_rates, eo));
  if (rec > 0) {
    // Random layer inputs of the activation dtype, reused chunk by chunk (values do not change
    // the speed), at positions after the sink.
    const DType dtype = gpu_worker::ExactRecompute::ActivationDType(o.model->layer(0).qkv.dtype);
    const int64_t chunk = std::min<int64_t>(rec, 4096);
    const size_t count = static_cast<size_t>(chunk * c.hidden_size);
    TANDEM_ASSIGN_OR_RETURN(gpu_worker::DeviceBuffer rows,
                            backend.Allocate(count * gpu_worker::DTypeBytes(dtype)));
    TANDEM_RETURN_IF_ERROR(backend.RandomFill({rows.data(), dtype, count, o.seed + 31, 1.0f}));
    std::vector<char> host_rows(count * gpu_worker::DTypeBytes(dtype));
    TANDEM_RETURN_IF_ERROR(backend.CopyToHost(host_rows.data(), rows.data(), host_rows.size()));
    for (int64_t done = 0; done < rec; done += chunk) {
      TANDEM_RETURN_IF_ERROR(tier->AppendRecomputeRows(
          backend, o.max_chunk, host_rows.data(), std::min(chunk, rec - done), o.sink + done));
    }
  }
  return std::unique_ptr<gpu_worker::OffloadTier>(std::move(tier));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Sequence>> MakeSyntheticSequence(
    Backend& backend, const gpu_worker::ModelConfig& c, gpu_worker::NodePool* pool,
    AttentionMode mode, const std::string& id, const SyntheticContextOptions& o) {
  if (o.context < 1 || o.window < o.block || o.sink < 0 || o.block < 1 || o.max_chunk < 1 ||
      !(o.share > 0.0 && o.share <= 1.0) ||
      (!o.head_shares.empty() &&
       static_cast<int64_t>(o.head_shares.size()) != c.num_layers * c.num_kv_heads)) {
    return absl::InvalidArgumentError("synthetic context: bad options");
  }
  if ((mode == AttentionMode::kHybrid || mode == AttentionMode::kExact) && pool == nullptr) {
    return absl::InvalidArgumentError("synthetic context: hybrid and exact need CPU nodes");
  }
  const gpu_worker::WindowGeometry geometry{c.num_layers, c.num_kv_heads, c.head_dim,
                                            DType::kBF16};
  gpu_worker::WindowOptions wo;
  wo.block = o.block;
  wo.max_chunk = o.max_chunk;
  wo.max_context = o.context + o.extra_positions;
  const bool windowed = mode != AttentionMode::kGpu;
  wo.window = windowed ? o.window : gpu_worker::WindowOptions::kUnlimited;
  wo.sink = windowed ? o.sink : 0;
  TANDEM_ASSIGN_OR_RETURN(WindowCache window, WindowCache::Create(backend, geometry, wo));
  const size_t per_tensor =
      static_cast<size_t>(c.num_kv_heads) * window.capacity() * c.head_dim;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    TANDEM_RETURN_IF_ERROR(
        backend.RandomFill({window.k(l), DType::kBF16, per_tensor, o.seed + 100 + 2 * l, 1.0f}));
    TANDEM_RETURN_IF_ERROR(
        backend.RandomFill({window.v(l), DType::kBF16, per_tensor, o.seed + 101 + 2 * l, 1.0f}));
  }
  auto seq = std::make_unique<Sequence>(id, mode, std::move(window));
  if (!windowed) {
    TANDEM_RETURN_IF_ERROR(AppendPositions(seq->window, o.context, o.max_chunk));
    return seq;
  }
  // sink, then the offloaded middle (a whole number of blocks), then at most `window` recent.
  const int64_t sink = std::min(o.sink, o.context);
  const int64_t offloaded =
      std::max<int64_t>(CeilTo(o.context - sink - o.window, o.block), 0);
  const int64_t recent = o.context - sink - offloaded;
  if (recent < 0) return absl::InvalidArgumentError("synthetic context: context too short");
  if (sink > 0) TANDEM_RETURN_IF_ERROR(AppendPositions(seq->window, sink, o.max_chunk));
  if (offloaded > 0) {
    if (sink < o.sink) return absl::InvalidArgumentError("synthetic context: context too short");
    TANDEM_RETURN_IF_ERROR(seq->window.Skip(offloaded));
    if (mode == AttentionMode::kExact) {
      TANDEM_ASSIGN_OR_RETURN(seq->offload, MakeExactTier(backend, c, *pool, id, o, offloaded));
    } else {
      // The serving path's tier (tier_factory.h), seeded with random entries.
      gpu_worker::TierSpec tier;
      tier.mode = mode;
      tier.geometry = geometry;
      tier.node = NodeSessionOptions(c, o, id);
      tier.node.beta = o.beta;
      tier.node.expected_tokens = offloaded + o.extra_positions;
      tier.node.selection = o.selection;
      tier.node.page_tokens = static_cast<uint32_t>(o.summary_page_tokens);
      tier.summary_tokens = offloaded + o.extra_positions;
      tier.low_rank = o.low_rank;
      tier.host_page_tokens = o.page_tokens;
      tier.seed_nodes = [&](gpu_worker::RemoteKv& remote) {
        return FillRemote(remote, c, o, offloaded);
      };
      tier.seed_pages = [&](gpu_worker::PageIndex& index) {
        return FillPageIndex(backend, c, o, offloaded, index);
      };
      tier.seed_host = [&](gpu_worker::OffloadedKv& kv) {
        return FillHostPages(backend, kv, c, o, offloaded);
      };
      TANDEM_ASSIGN_OR_RETURN(seq->offload, gpu_worker::OpenOffloadTier(backend, pool, tier));
      if (gpu_worker::PagePolicy* policy = seq->offload->page_policy()) *policy = o.page_policy;
    }
  }
  if (recent > 0) TANDEM_RETURN_IF_ERROR(AppendPositions(seq->window, recent, o.max_chunk));
  // The window's MAW: every entry seen, at the uniform weight (the eviction of these entries
  // during decode then carries plausible values).
  for (int64_t l = 0; l < c.num_layers; ++l) {
    TANDEM_RETURN_IF_ERROR(backend.Fill(seq->window.maw(l),
                                        1.0f / static_cast<float>(sink + o.window),
                                        static_cast<size_t>(c.num_kv_heads) *
                                            seq->window.capacity()));
  }
  return seq;
}

}  // namespace tandem::bench
