#include "tandem/gpu_worker/exact_probe.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "tandem/common/status_macros.h"
#include "tandem/gpu_worker/remote_kv.h"

namespace tandem::gpu_worker {
namespace {

using Clock = std::chrono::steady_clock;

// Best wall time of `repeats` runs of `run` after one warm-up run (seconds).
absl::StatusOr<double> BestOf(int repeats, const std::function<absl::Status()>& run) {
  TANDEM_RETURN_IF_ERROR(run());
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < std::max(1, repeats); ++i) {
    const Clock::time_point t0 = Clock::now();
    TANDEM_RETURN_IF_ERROR(run());
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return std::max(best, 1e-9);
}

// The probes' sizes (ProbeDeviceRates and ProbeDeviceBytes): entries of the attention probe
// and rows of the recompute GEMM.
int64_t AttendProbeTokens(const ExactGeometry& g, DType kv_dtype, const ExactProbeOptions& o) {
  const size_t row = g.head_dim * DTypeBytes(kv_dtype);
  return std::max<int64_t>(16, o.device_kv_bytes / (2 * g.num_kv_heads * row));
}
int64_t GemmProbeRows(const ExactGeometry& g, const ExactProbeOptions& o) {
  const int64_t n = 2 * g.num_kv_heads * g.head_dim, k = g.hidden_size;
  return std::clamp<int64_t>(static_cast<int64_t>(o.gemm_flops / (2.0 * n * k)), 1, 4096);
}

// Queues `bytes` of host -> device uploads on upload slot 0 in pieces of at most the buffers'
// size (the same page-locked source and device destination each time), then makes the compute
// stream wait for them and releases the slot. Returns at once on cuda; the cpu backend copies.
absl::Status QueueUploads(Backend& backend, const DeviceBuffer& host, const DeviceBuffer& dev,
                          double bytes) {
  double left = std::max(bytes, 1.0);
  while (left > 0) {
    const size_t piece = static_cast<size_t>(std::min(left, static_cast<double>(host.bytes())));
    UploadParams u;
    u.dst = dev.data();
    u.dst_pitch = piece;
    u.src_host = host.data();
    u.src_pitch = piece;
    u.row_bytes = piece;
    u.rows = 1;
    TANDEM_RETURN_IF_ERROR(backend.UploadAsync(u, 0));
    left -= static_cast<double>(std::max<size_t>(piece, 1));
  }
  TANDEM_RETURN_IF_ERROR(backend.WaitUpload(0));
  return backend.ReleaseUpload(0);
}

// The two paths at once over the open probe session `remote` (`bytes` of K/V over all nodes,
// attended alone in `node_alone_s`): see exact_probe.h. Sets the rates together and keeps
// those alone.
absl::Status ProbeTogether(Backend& backend, RemoteKv& remote, double bytes, double node_alone_s,
                           const ExactProbeOptions& o, std::vector<float>& q,
                           std::vector<float>& out, std::vector<float>& lse,
                           ExactPathRates& rates) {
  const double pcie_alone = rates.pcie_bytes_per_second;
  TANDEM_ASSIGN_OR_RETURN(DeviceBuffer host, backend.AllocateHost(o.pcie_bytes));
  TANDEM_ASSIGN_OR_RETURN(DeviceBuffer dev, backend.Allocate(o.pcie_bytes));
  std::fill_n(static_cast<char*>(host.data()), o.pcie_bytes, char{1});
  auto attend = [&]() -> absl::Status {
    TANDEM_RETURN_IF_ERROR(remote.StartAttend(0, q.data(), 1, nullptr));
    TANDEM_ASSIGN_OR_RETURN(const bool degraded, remote.FinishAttend(out.data(), lse.data()));
    if (degraded) return absl::DeadlineExceededError("exact probe: a node did not answer");
    return absl::OkStatus();
  };
  // The nodes under PCIe load: uploads for ~3x the nodes' time alone are queued first (on
  // cuda they run behind the host's back), then one attend is timed.
  const double load_bytes = 3.0 * pcie_alone * node_alone_s;
  double node_s = std::numeric_limits<double>::infinity();
  for (int i = 0; i <= std::max(1, o.repeats); ++i) {
    TANDEM_RETURN_IF_ERROR(QueueUploads(backend, host, dev, load_bytes));
    const Clock::time_point t0 = Clock::now();
    absl::Status attended = attend();
    const double t = std::chrono::duration<double>(Clock::now() - t0).count();
    TANDEM_RETURN_IF_ERROR(backend.Synchronize());
    TANDEM_RETURN_IF_ERROR(attended);
    if (i > 0) node_s = std::min(node_s, t);  // run 0 warms up
  }
  // PCIe under node load: one attend started, then uploads of ~half its time alone, waited for.
  const double timed_bytes = std::max(0.5 * pcie_alone * node_alone_s, 1.0);
  double pcie_s = std::numeric_limits<double>::infinity();
  for (int i = 0; i <= std::max(1, o.repeats); ++i) {
    TANDEM_RETURN_IF_ERROR(remote.StartAttend(0, q.data(), 1, nullptr));
    const Clock::time_point t0 = Clock::now();
    absl::Status uploaded = QueueUploads(backend, host, dev, timed_bytes);
    if (uploaded.ok()) uploaded = backend.Synchronize();
    const double t = std::chrono::duration<double>(Clock::now() - t0).count();
    absl::StatusOr<bool> degraded = remote.FinishAttend(out.data(), lse.data());
    TANDEM_RETURN_IF_ERROR(uploaded);
    TANDEM_RETURN_IF_ERROR(degraded.status());
    if (*degraded) return absl::DeadlineExceededError("exact probe: a node did not answer");
    if (i > 0) pcie_s = std::min(pcie_s, t);
  }
  rates.pcie_alone_bytes_per_second = pcie_alone;
  rates.node_alone_bytes_per_second = rates.node_bytes_per_second;
  // Never faster together than alone (a quiet run's noise).
  rates.pcie_bytes_per_second = std::min(pcie_alone, timed_bytes / std::max(pcie_s, 1e-9));
  rates.node_bytes_per_second =
      std::min(rates.node_alone_bytes_per_second, bytes / std::max(node_s, 1e-9));
  return absl::OkStatus();
}

}  // namespace

size_t ProbeDeviceBytes(const ExactGeometry& g, DType kv_dtype, bool host_is_device,
                        const ExactProbeOptions& o) {
  const size_t pcie = o.pcie_bytes * (host_is_device ? 2 : 1);
  const int64_t hkv = g.num_kv_heads, d = g.head_dim;
  const int64_t tokens = AttendProbeTokens(g, kv_dtype, o);
  const size_t attend =
      2 * hkv * tokens * d * DTypeBytes(kv_dtype) + 2 * hkv * d * 4 + hkv * 4 + tokens * 4 + 4;
  const int64_t m = GemmProbeRows(g, o), n = 2 * hkv * d, k = g.hidden_size;
  const size_t gemm = m * k * 4 + n * k * DTypeBytes(kv_dtype) + m * n * 4;
  return std::max({pcie, attend, gemm});
}

absl::StatusOr<ExactPathRates> ProbeDeviceRates(Backend& backend, const ExactGeometry& g,
                                                DType kv_dtype, const ExactProbeOptions& o) {
  if (g.num_kv_heads < 1 || g.head_dim < 1 || g.hidden_size < 1) {
    return absl::InvalidArgumentError("exact probe: bad geometry");
  }
  ExactPathRates rates;
  // PCIe: one page-locked buffer over the upload stream (slot 0), as KvStreamer copies pages.
  {
    TANDEM_ASSIGN_OR_RETURN(DeviceBuffer host, backend.AllocateHost(o.pcie_bytes));
    TANDEM_ASSIGN_OR_RETURN(DeviceBuffer dev, backend.Allocate(o.pcie_bytes));
    std::fill_n(static_cast<char*>(host.data()), o.pcie_bytes, char{1});
    TANDEM_ASSIGN_OR_RETURN(const double t, BestOf(o.repeats, [&]() -> absl::Status {
                              UploadParams u;
                              u.dst = dev.data();
                              u.dst_pitch = o.pcie_bytes;
                              u.src_host = host.data();
                              u.src_pitch = o.pcie_bytes;
                              u.row_bytes = o.pcie_bytes;
                              u.rows = 1;
                              TANDEM_RETURN_IF_ERROR(backend.UploadAsync(u, 0));
                              TANDEM_RETURN_IF_ERROR(backend.WaitUpload(0));
                              TANDEM_RETURN_IF_ERROR(backend.ReleaseUpload(0));
                              return backend.Synchronize();
                            }));
    rates.pcie_bytes_per_second = o.pcie_bytes / t;
  }
  // Device attention: one decode query row over `tokens` entries of every kv head.
  {
    const int64_t hkv = g.num_kv_heads, d = g.head_dim;
    const size_t row = d * DTypeBytes(kv_dtype);
    const int64_t tokens = AttendProbeTokens(g, kv_dtype, o);
    const size_t half = hkv * tokens * row;
    TANDEM_ASSIGN_OR_RETURN(DeviceBuffer k, backend.Allocate(half));
    TANDEM_ASSIGN_OR_RETURN(DeviceBuffer v, backend.Allocate(half));
    TANDEM_ASSIGN_OR_RETURN(DeviceBuffer q, backend.Allocate(hkv * d * 4));
    TANDEM_ASSIGN_OR_RETURN(DeviceBuffer out, backend.Allocate(hkv * d * 4));
    TANDEM_ASSIGN_OR_RETURN(DeviceBuffer lse, backend.Allocate(hkv * 4));
    TANDEM_ASSIGN_OR_RETURN(DeviceBuffer pos, backend.Allocate(tokens * 4 + 4));
    const size_t elems = hkv * tokens * d;
    TANDEM_RETURN_IF_ERROR(backend.RandomFill({k.data(), kv_dtype, elems, 1, 0.1f}));
    TANDEM_RETURN_IF_ERROR(backend.RandomFill({v.data(), kv_dtype, elems, 2, 0.1f}));
    TANDEM_RETURN_IF_ERROR(backend.RandomFill({q.data(), DType::kF32, size_t(hkv * d), 3, 0.1f}));
    std::vector<int32_t> positions(tokens + 1, 0);
    positions[tokens] = static_cast<int32_t>(tokens);  // the query, after every entry
    TANDEM_RETURN_IF_ERROR(
        backend.CopyToDevice(pos.data(), positions.data(), positions.size() * 4));
    WindowAttentionParams wa;
    wa.q = q.as<float>();
    wa.q_row_stride = hkv * d;
    wa.q_pos = pos.as<int32_t>() + tokens;
    wa.k_cache = k.data();
    wa.v_cache = v.data();
    wa.cache_dtype = kv_dtype;
    wa.slot_pos = pos.as<int32_t>();
    wa.num_slots = tokens;
    wa.capacity = tokens;
    wa.num_tokens = 1;
    wa.num_q_heads = hkv;
    wa.num_kv_heads = hkv;
    wa.head_dim = d;
    wa.scale = 1.0f / std::sqrt(static_cast<float>(d));
    wa.o = out.as<float>();
    wa.lse = lse.as<float>();
    TANDEM_ASSIGN_OR_RETURN(const double t, BestOf(o.repeats, [&]() -> absl::Status {
                              TANDEM_RETURN_IF_ERROR(backend.WindowAttention(wa));
                              return backend.Synchronize();
                            }));
    rates.device_attend_bytes_per_second = 2.0 * half / t;
  }
  // Recompute GEMM: x [m, hidden] f32 by W [2·H_kv·D, hidden] of the KV dtype (K and V at once).
  {
    const int64_t n = 2 * g.num_kv_heads * g.head_dim, k = g.hidden_size;
    const int64_t m = GemmProbeRows(g, o);
    TANDEM_ASSIGN_OR_RETURN(DeviceBuffer x, backend.Allocate(m * k * 4));
    TANDEM_ASSIGN_OR_RETURN(DeviceBuffer w, backend.Allocate(n * k * DTypeBytes(kv_dtype)));
    TANDEM_ASSIGN_OR_RETURN(DeviceBuffer y, backend.Allocate(m * n * 4));
    TANDEM_RETURN_IF_ERROR(backend.RandomFill({x.data(), DType::kF32, size_t(m * k), 4, 0.1f}));
    TANDEM_RETURN_IF_ERROR(backend.RandomFill({w.data(), kv_dtype, size_t(n * k), 5, 0.1f}));
    MatMulParams mm;
    mm.x = x.as<float>();
    mm.w = w.data();
    mm.w_dtype = kv_dtype;
    mm.y = y.as<float>();
    mm.m = m;
    mm.n = n;
    mm.k = k;
    TANDEM_ASSIGN_OR_RETURN(const double t, BestOf(o.repeats, [&]() -> absl::Status {
                              TANDEM_RETURN_IF_ERROR(backend.MatMul(mm));
                              return backend.Synchronize();
                            }));
    rates.gemm_flops_per_second = 2.0 * m * n * k / t;
  }
  return rates;
}

absl::Status ProbeNodeRates(NodePool& pool, const ExactGeometry& g, DType kv_dtype,
                            ExactPathRates& rates, const ExactProbeOptions& o, Backend* pcie) {
  rates.nodes = 0;
  rates.node_bytes_per_second = 0;
  const std::vector<NodeState> states = pool.Snapshot();
  uint64_t least_free = std::numeric_limits<uint64_t>::max();
  size_t accepting = 0;
  for (const NodeState& s : states) {
    if (!s.accepting()) continue;
    ++accepting;
    least_free = std::min(least_free, s.free_bytes);
  }
  if (accepting == 0) return absl::OkStatus();
  const int64_t d = g.head_dim;
  const size_t row = d * DTypeBytes(kv_dtype);
  const size_t per_node = std::min<size_t>(o.node_bytes, least_free / 4);
  const int64_t tokens = static_cast<int64_t>(per_node / (2 * row));
  if (tokens < 16) {
    return absl::ResourceExhaustedError("exact probe: the CPU nodes have no room for a probe");
  }
  RemoteKvOptions ro;
  // Distinct from any other probe of this pool (the clock's ticks).
  ro.session_id = absl::StrCat("exact-probe-", Clock::now().time_since_epoch().count());
  ro.num_layers = 1;
  ro.num_q_heads = static_cast<int64_t>(accepting);
  ro.num_kv_heads = static_cast<int64_t>(accepting);
  ro.head_dim = d;
  ro.kv_dtype = kv_dtype;
  ro.selection = SelectionRule::kPages;      // no selected copy; dense attends
  ro.placement = PlacementPolicy::kUniform;  // one head per node
  ro.expected_tokens = tokens;
  ro.attend_deadline_ms = o.attend_deadline_ms;
  ro.replan_every_steps = 0;
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<RemoteKv> remote, RemoteKv::Open(pool, ro));
  // Entries whose values do not matter for the rate (zeros: a constant softmax), appended in
  // pieces of <= 8 MiB per head so that the staging stays bounded.
  absl::Status appended = absl::OkStatus();
  const int64_t piece = std::max<int64_t>(16, static_cast<int64_t>((size_t{8} << 20) / row));
  std::vector<char> kv_piece;
  std::vector<float> maw;
  for (int64_t at = 0; at < tokens && appended.ok(); at += piece) {
    const int64_t count = std::min(piece, tokens - at);
    kv_piece.assign(accepting * count * row, 0);
    maw.assign(accepting * count, 0.0f);
    appended = remote->Append(0, kv_piece.data(), kv_piece.data(), maw.data(), count, 0);
  }
  if (!appended.ok()) {
    (void)remote->Close();
    return appended;
  }
  std::vector<float> q(accepting * d, 0.01f), out(accepting * d), lse(accepting);
  absl::StatusOr<double> t = BestOf(o.repeats, [&]() -> absl::Status {
    TANDEM_RETURN_IF_ERROR(remote->StartAttend(0, q.data(), 1, nullptr));
    TANDEM_ASSIGN_OR_RETURN(const bool degraded, remote->FinishAttend(out.data(), lse.data()));
    if (degraded) return absl::DeadlineExceededError("exact probe: a node did not answer");
    return absl::OkStatus();
  });
  const double bytes = static_cast<double>(accepting) * tokens * 2 * row;
  absl::Status together = t.status();
  if (t.ok()) {
    rates.nodes = accepting;
    rates.node_bytes_per_second = bytes / *t;
    rates.node_overhead_seconds = ro.attend_overhead_seconds;
    if (pcie != nullptr && rates.pcie_bytes_per_second > 0) {
      // Not fatal: without it the plan uses the rates alone (as before the concurrent probe).
      ExactPathRates measured = rates;
      const absl::Status both = ProbeTogether(*pcie, *remote, bytes, *t, o, q, out, lse, measured);
      if (both.ok()) {
        rates = measured;
      } else {
        spdlog::warn(
            "exact probe: the paths at once were not measured ({}); planning with the "
            "rates alone",
            both.ToString());
      }
    }
  }
  const absl::Status closed = remote->Close();
  TANDEM_RETURN_IF_ERROR(together);
  return closed;
}

absl::StatusOr<std::unique_ptr<ExactRateBook>> ExactRateBook::Measure(
    Backend& backend, NodePool& pool, const ExactGeometry& geometry, DType kv_dtype,
    const ExactProbeOptions& options) {
  const Clock::time_point t0 = Clock::now();
  TANDEM_ASSIGN_OR_RETURN(ExactPathRates rates,
                          ProbeDeviceRates(backend, geometry, kv_dtype, options));
  TANDEM_RETURN_IF_ERROR(ProbeNodeRates(pool, geometry, kv_dtype, rates, options, &backend));
  spdlog::info("exact mode rates (probed in {:.0f} ms): {}",
               1e3 * std::chrono::duration<double>(Clock::now() - t0).count(),
               FormatExactRates(rates));
  return std::make_unique<ExactRateBook>(rates);
}

void ExactRateBook::RecordNodeRate(double bytes_per_second) {
  if (!std::isfinite(bytes_per_second) || bytes_per_second <= 0) return;
  // The first session sample replaces the probe's (an idle node, a small probe); later ones
  // move the average by a fifth each.
  rates_.node_bytes_per_second = node_samples_ == 0
                                     ? bytes_per_second
                                     : 0.8 * rates_.node_bytes_per_second + 0.2 * bytes_per_second;
  ++node_samples_;
}

void ExactRateBook::RecordStep(const ExactStepTimes& t, double fetched_bytes, double node_bytes,
                               int64_t layers) {
  if (!(t.span_s > 0) || !std::isfinite(t.span_s) || layers < 1 || !(node_bytes > 0) ||
      !(fetched_bytes > 0) || !(rates_.node_bytes_per_second > 0)) {
    return;
  }
  auto ema = [](double old, double sample, uint64_t& samples) {
    const double v = samples == 0 ? sample : 0.8 * old + 0.2 * sample;
    ++samples;
    return v;
  };
  const double modelled_scan = node_bytes / rates_.node_bytes_per_second;
  const double scanning = t.node_busy_s - layers * round_trip_seconds_;
  if (modelled_scan >= kMinRatedScanSecondsPerLayer * static_cast<double>(layers) &&
      scanning >= 0.5 * t.node_busy_s) {
    // One step moves the rate by at most kMaxRateStep either way (a stall, a short busy time).
    const double sample = std::clamp(node_bytes / scanning,
                                     rates_.node_bytes_per_second / kMaxRateStep,
                                     rates_.node_bytes_per_second * kMaxRateStep);
    rates_.node_bytes_per_second = ema(rates_.node_bytes_per_second, sample, node_samples_);
    rates_.node_overhead_seconds = ema(rates_.node_overhead_seconds,
                                       round_trip_seconds_ + t.tail_s / layers, overhead_samples_);
  } else {
    const double overhead = std::max(0.0, (t.node_busy_s + t.tail_s - modelled_scan) / layers);
    rates_.node_overhead_seconds = ema(rates_.node_overhead_seconds, overhead, overhead_samples_);
  }
  const bool rated = rates_.pcie_bytes_per_second > 0 &&
                     fetched_bytes / rates_.pcie_bytes_per_second >=
                         kMinRatedFetchSecondsPerLayer * static_cast<double>(layers);
  if (rated && t.fetch_excess_s > kFetchBoundShare * t.span_s) {
    rates_.pcie_bytes_per_second =
        ema(rates_.pcie_bytes_per_second, fetched_bytes / t.span_s, pcie_samples_);
  }
}

}  // namespace tandem::gpu_worker
