#include "tandem/gpu_worker/exact_planner.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_format.h"

namespace tandem::gpu_worker {
namespace {

// One constraint a·(f, r, T) <= b of the step LP.
struct Row {
  std::array<double, 3> a;
  double b;
};

struct Costs {
  double k = 0;      // K+V bytes of the whole step (all layers, all entries)
  double x = 0;      // activation bytes of the same entries
  double flops = 0;  // recompute GEMM flops of the same entries
  double pcie = 0, device = 0, gemm = 0, nodes = 0, overhead = 0;
};

// Seconds of each resource for shares (f, r) and node share 1 - f - r.
struct Times {
  double pcie = 0, device = 0, nodes = 0;
  double step() const { return std::max({pcie, device, nodes}); }
};

Times TimesOf(const Costs& c, double f, double r) {
  Times t;
  // (A residue of rounding is no node share: the nodes' overhead is paid only for real work.)
  const double n = 1.0 - f - r > 1e-9 ? 1.0 - f - r : 0.0;
  if (c.pcie > 0) t.pcie = (f * c.k + r * c.x) / c.pcie;
  if (c.device > 0) t.device = (f + r) * c.k / c.device;
  if (c.gemm > 0) t.device += r * c.flops / c.gemm;
  if (n > 0) {
    t.nodes =
        c.nodes > 0 ? n * c.k / c.nodes + c.overhead : std::numeric_limits<double>::infinity();
  }
  return t;
}

// Solves a 3x3 system by Cramer's rule; false when (nearly) singular.
bool Solve3(const Row& p, const Row& q, const Row& s, std::array<double, 3>& v) {
  auto det = [](const std::array<double, 3>& a, const std::array<double, 3>& b,
                const std::array<double, 3>& c) {
    return a[0] * (b[1] * c[2] - b[2] * c[1]) - a[1] * (b[0] * c[2] - b[2] * c[0]) +
           a[2] * (b[0] * c[1] - b[1] * c[0]);
  };
  // Singular relative to the rows' sizes (the coefficients are seconds: 1e-9..1e3).
  auto size = [](const std::array<double, 3>& a) {
    return std::max({std::fabs(a[0]), std::fabs(a[1]), std::fabs(a[2])});
  };
  const double d = det(p.a, q.a, s.a);
  if (std::fabs(d) <= 1e-12 * size(p.a) * size(q.a) * size(s.a)) return false;
  for (int i = 0; i < 3; ++i) {
    std::array<double, 3> pa = p.a, qa = q.a, sa = s.a;
    pa[i] = p.b;
    qa[i] = q.b;
    sa[i] = s.b;
    v[i] = det(pa, qa, sa) / d;
  }
  return true;
}

// min T over the polytope `rows` by vertex enumeration; false when infeasible. Ties: the
// vertex with the least recompute, then the most fetch (fewest node calls).
bool MinimiseStep(const std::vector<Row>& rows, double& f, double& r, double& t) {
  bool found = false;
  const size_t m = rows.size();
  for (size_t i = 0; i < m; ++i) {
    for (size_t j = i + 1; j < m; ++j) {
      for (size_t k = j + 1; k < m; ++k) {
        std::array<double, 3> v;
        if (!Solve3(rows[i], rows[j], rows[k], v)) continue;
        bool feasible = true;
        for (const Row& row : rows) {
          const double lhs = row.a[0] * v[0] + row.a[1] * v[1] + row.a[2] * v[2];
          if (lhs > row.b + 1e-9 * (1.0 + std::fabs(row.b))) {
            feasible = false;
            break;
          }
        }
        if (!feasible) continue;
        const double tol = 1e-9 * (1.0 + std::fabs(t));
        const bool better =
            !found || v[2] < t - tol ||
            (v[2] <= t + tol && (v[1] < r - 1e-9 || (v[1] <= r + 1e-9 && v[0] > f + 1e-9)));
        if (better) {
          f = v[0];
          r = v[1];
          t = v[2];
          found = true;
        }
      }
    }
  }
  return found;
}

// The LP of exact_planner.h with or without nodes and recompute. Returns (f, r).
std::array<double, 2> SolveSplit(const Costs& c, bool use_nodes, bool use_recompute) {
  std::vector<Row> rows;
  // PCIe: f·K/pcie + r·X/pcie - T <= 0 (no PCIe rate: nothing crosses it).
  if (c.pcie > 0) {
    rows.push_back({{c.k / c.pcie, c.x / c.pcie, -1.0}, 0.0});
  } else {
    rows.push_back({{1.0, 0.0, 0.0}, 0.0});
    use_recompute = false;
  }
  // Device: (f + r)·K/device + r·F/gemm - T <= 0 (an unmeasured rate counts as free).
  const double dev = c.device > 0 ? c.k / c.device : 0.0;
  const double gemm = c.gemm > 0 ? c.flops / c.gemm : 0.0;
  rows.push_back({{dev, dev + gemm, -1.0}, 0.0});
  if (use_nodes) {
    // (1 - f - r)·K/nodes + L·overhead - T <= 0.
    const double a = c.k / c.nodes;
    rows.push_back({{-a, -a, -1.0}, -(a + c.overhead)});
  } else {
    rows.push_back({{-1.0, -1.0, 0.0}, -1.0});  // f + r >= 1
  }
  rows.push_back({{-1.0, 0.0, 0.0}, 0.0});                                    // f >= 0
  rows.push_back({{0.0, -1.0, 0.0}, 0.0});                                    // r >= 0
  rows.push_back({{1.0, 1.0, 0.0}, 1.0});                                     // f + r <= 1
  rows.push_back({{0.0, 0.0, -1.0}, 0.0});                                    // T >= 0
  if (!use_recompute || c.gemm <= 0) rows.push_back({{0.0, 1.0, 0.0}, 0.0});  // r <= 0
  double f = 0, r = 0, t = 0;
  if (!MinimiseStep(rows, f, r, t)) return {use_nodes ? 0.0 : 1.0, 0.0};
  f = std::clamp(f, 0.0, 1.0);
  r = std::clamp(r, 0.0, 1.0 - f);
  if (r < 1e-12) r = 0.0;
  if (!use_nodes || 1.0 - f - r <= 1e-9) {  // nothing left for the nodes
    if (r > 0) {
      r = 1.0 - f;
    } else {
      f = 1.0;
    }
  }
  return {f, r};
}

// Best split over "with nodes" and "without nodes" (the node overhead is paid only when the
// nodes hold something).
std::array<double, 2> BestSplit(const Costs& c, bool use_recompute) {
  const bool have_nodes = c.nodes > 0;
  const bool have_pcie = c.pcie > 0;
  if (!have_pcie) return {0.0, 0.0};
  std::array<double, 2> best = SolveSplit(c, /*use_nodes=*/false, use_recompute);
  if (have_nodes) {
    const std::array<double, 2> with = SolveSplit(c, /*use_nodes=*/true, use_recompute);
    if (TimesOf(c, with[0], with[1]).step() < TimesOf(c, best[0], best[1]).step()) best = with;
  }
  return best;
}

}  // namespace

ExactPlan PlanExactSplit(const ExactPathRates& rates, const ExactGeometry& g, int64_t tokens,
                         const ExactPlanOptions& options) {
  ExactPlan plan;
  plan.tokens = tokens;
  // Shares are chosen for at least one entry (an empty tier still needs a rule for the first).
  const double n = static_cast<double>(std::max<int64_t>(tokens, 1));
  Costs c;
  c.k = g.num_layers * n * g.kv_row_bytes();
  c.x = g.num_layers * n * g.activation_row_bytes();
  c.flops = g.num_layers * n * 2.0 * g.hidden_size * 2.0 * g.num_kv_heads * g.head_dim;
  c.pcie = rates.pcie_bytes_per_second;
  c.device = rates.device_attend_bytes_per_second;
  c.gemm = rates.gemm_flops_per_second;
  c.nodes = rates.nodes > 0 ? rates.node_bytes_per_second : 0.0;
  c.overhead = g.num_layers * rates.node_overhead_seconds;

  const std::array<double, 2> plain = BestSplit(c, /*use_recompute=*/false);
  const std::array<double, 2> kvpr = BestSplit(c, /*use_recompute=*/true);
  const double t_plain = TimesOf(c, plain[0], plain[1]).step();
  const double t_kvpr = TimesOf(c, kvpr[0], kvpr[1]).step();
  plan.recompute_pays = kvpr[1] > 0 && t_kvpr < t_plain * (1 - 1e-9);
  plan.recompute_gain = plan.recompute_pays ? 1.0 - t_kvpr / t_plain : 0.0;
  const double xr = g.activation_row_bytes(), kr = g.kv_row_bytes();
  if (xr >= kr) {
    plan.recompute_reason = absl::StrFormat(
        "recompute does not pay: the activation row (%d x %d B = %.0f B) is not smaller than "
        "the K+V row it replaces (2 x %d x %d x %d B = %.0f B)",
        g.hidden_size, g.activation_bytes, xr, g.num_kv_heads, g.head_dim, g.kv_bytes, kr);
  } else if (c.gemm <= 0 || c.pcie <= 0) {
    plan.recompute_reason = "recompute not planned: no measured GEMM or PCIe rate";
  } else if (!plan.recompute_pays) {
    plan.recompute_reason = absl::StrFormat(
        "recompute does not pay here: activations are %.2fx the K+V bytes, but the GEMM "
        "(%.1f TFLOP/s measured) or the other paths bind first",
        xr / kr, c.gemm / 1e12);
  } else {
    plan.recompute_reason = absl::StrFormat(
        "recompute pays: activations are %.2fx the K+V bytes; the LP puts %.1f%% of the "
        "entries there, %.1f%% off the step",
        xr / kr, 100.0 * kvpr[1], 100.0 * plan.recompute_gain);
  }

  std::array<double, 2> chosen = options.allow_recompute ? kvpr : plain;
  if (options.force_fetch_share >= 0) {
    const double f = std::min(1.0, options.force_fetch_share);
    chosen = {f, std::clamp(options.force_recompute_share, 0.0, 1.0 - f)};
  }
  plan.fetch_share = chosen[0];
  plan.recompute_share = chosen[1];
  plan.node_share = 1.0 - chosen[0] - chosen[1] > 1e-9 ? 1.0 - chosen[0] - chosen[1] : 0.0;
  const Times t = TimesOf(c, chosen[0], chosen[1]);
  plan.pcie_seconds = t.pcie;
  plan.device_seconds = t.device;
  plan.node_seconds = t.nodes;
  plan.step_seconds = t.step();
  // Offload mode and the combined limit: the rates of each path alone (nothing else reads
  // the host's DRAM while it streams).
  Costs alone = c;
  alone.pcie = rates.pcie_alone();
  alone.nodes = rates.nodes > 0 ? rates.node_alone() : 0.0;
  plan.fetch_only_seconds = TimesOf(alone, 1.0, 0.0).step();
  const double pcie_path = alone.device > 0 && alone.pcie > 0 ? std::min(alone.pcie, alone.device)
                                                              : std::max(alone.pcie, 0.0);
  plan.combined_limit_seconds =
      pcie_path + alone.nodes > 0 ? alone.k / (pcie_path + alone.nodes) : 0.0;
  return plan;
}

std::string FormatExactPlan(const ExactPlan& p) {
  return absl::StrFormat(
      "exact plan for %d entries/(layer, kv head): fetch %.1f%%, nodes %.1f%%, recompute %.1f%%; "
      "modelled step %.4g s (pcie %.4g, device %.4g, nodes %.4g; fetch only %.4g, combined "
      "limit %.4g); %s",
      p.tokens, 100 * p.fetch_share, 100 * p.node_share, 100 * p.recompute_share, p.step_seconds,
      p.pcie_seconds, p.device_seconds, p.node_seconds, p.fetch_only_seconds,
      p.combined_limit_seconds, p.recompute_reason);
}

std::string FormatExactRates(const ExactPathRates& r) {
  return absl::StrFormat(
      "pcie %.2f GB/s (alone %.2f), device attention %.2f GB/s, gemm %.3g TFLOP/s, %d nodes "
      "%.2f GB/s (alone %.2f; overhead %.0f us per attend)",
      r.pcie_bytes_per_second / 1e9, r.pcie_alone() / 1e9, r.device_attend_bytes_per_second / 1e9,
      r.gemm_flops_per_second / 1e12, r.nodes, r.node_bytes_per_second / 1e9, r.node_alone() / 1e9,
      r.node_overhead_seconds * 1e6);
}

}  // namespace tandem::gpu_worker
