#include "tandem/gpu_worker/placement_planner.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "placement_search.h"
#include "tandem/common/byte_size.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {
namespace {

using placement_internal::Candidate;
using placement_internal::Clock;
using placement_internal::kTolerance;
using placement_internal::Problem;
using placement_internal::Search;
using placement_internal::State;

constexpr double kUnknownRate = 1e10;  // bytes/s assumed when no node reports a rate
// A placement holds [layers × nodes] tables (12 bytes a cell) and the search keeps three
// placements; this bounds them to ~40 MB.
constexpr size_t kMaxCells = size_t{1} << 20;
// Iterated local search after the starts: at most this many perturbation rounds; it stops
// earlier after this many rounds in a row that found nothing better.
constexpr int kMaxKickRounds = 256;
constexpr int kKickPatience = 32;

uint64_t SatAdd(uint64_t a, uint64_t b) {
  return a > std::numeric_limits<uint64_t>::max() - b ? std::numeric_limits<uint64_t>::max()
                                                      : a + b;
}

// [nodes] seconds per scanned byte, unknown rates replaced as the header says.
std::vector<double> SecondsPerByte(std::span<const PlacementNode> nodes) {
  double sum = 0;
  int known = 0;
  for (const PlacementNode& n : nodes) {
    if (n.scan_bytes_per_second > 0 && std::isfinite(n.scan_bytes_per_second)) {
      sum += n.scan_bytes_per_second;
      ++known;
    }
  }
  const double fallback = known > 0 ? sum / known : kUnknownRate;
  std::vector<double> out;
  out.reserve(nodes.size());
  for (const PlacementNode& n : nodes) {
    const bool ok = n.scan_bytes_per_second > 0 && std::isfinite(n.scan_bytes_per_second);
    out.push_back(1.0 / (ok ? n.scan_bytes_per_second : fallback));
  }
  return out;
}

absl::StatusOr<Problem> BuildProblem(std::span<const PlacementNode> nodes,
                                     std::span<const PlacementShard> shards) {
  if (nodes.size() > kMaxPlacementNodes || shards.size() > kMaxPlacementShards) {
    return absl::InvalidArgumentError(absl::StrCat(
        "placement of ", shards.size(), " shards on ", nodes.size(), " nodes is over the limits (",
        kMaxPlacementShards, " shards, ", kMaxPlacementNodes, " nodes)"));
  }
  Problem p;
  p.num_nodes = static_cast<int>(nodes.size());
  for (int n = 0; n < p.num_nodes; ++n) {
    const PlacementNode& node = nodes[n];
    if (std::isnan(node.scan_bytes_per_second) || std::isinf(node.scan_bytes_per_second)) {
      return absl::InvalidArgumentError(
          absl::StrCat("node ", n, ": scan_bytes_per_second is not finite"));
    }
    if (!std::isfinite(node.attend_overhead_seconds) || node.attend_overhead_seconds < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("node ", n, ": attend_overhead_seconds must be finite and >= 0, got ",
                       node.attend_overhead_seconds));
    }
    p.overhead.push_back(node.attend_overhead_seconds);
    p.accepting.push_back(node.accepting ? 1 : 0);
    p.capacity.push_back(node.accepting ? node.capacity_bytes : 0);
    if (node.accepting) {
      p.accepting_nodes.push_back(n);
      p.total_capacity = SatAdd(p.total_capacity, node.capacity_bytes);
    }
  }
  if (p.accepting_nodes.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no accepting node among ", nodes.size(), " nodes"));
  }
  p.sec_per_byte = SecondsPerByte(nodes);

  const int num_shards = static_cast<int>(shards.size());
  for (int s = 0; s < num_shards; ++s) {
    const PlacementShard& shard = shards[s];
    if (!std::isfinite(shard.scan_bytes) || shard.scan_bytes < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shard ", s, ": scan_bytes must be finite and >= 0, got ", shard.scan_bytes));
    }
    if (shard.current_node < -1 || shard.current_node >= p.num_nodes) {
      return absl::InvalidArgumentError(absl::StrCat("shard ", s, ": current_node ",
                                                     shard.current_node, " is not in [-1, ",
                                                     p.num_nodes, ")"));
    }
    if (shard.memory_bytes > std::numeric_limits<uint64_t>::max() - p.total_mem) {
      return absl::InvalidArgumentError("total memory_bytes of the shards overflows 64 bits");
    }
    p.total_mem += shard.memory_bytes;
    p.scan.push_back(shard.scan_bytes);
    p.mem.push_back(shard.memory_bytes);
    p.home.push_back(shard.current_node);
    p.layer_id.push_back(shard.layer);
    p.kv_head.push_back(shard.kv_head);
  }

  p.sorted.resize(num_shards);
  std::iota(p.sorted.begin(), p.sorted.end(), 0);
  std::sort(p.sorted.begin(), p.sorted.end(), [&](int a, int b) {
    return std::pair(shards[a].layer, shards[a].kv_head) <
           std::pair(shards[b].layer, shards[b].kv_head);
  });
  p.layer.assign(num_shards, -1);
  for (int i = 0; i < num_shards; ++i) {
    const int s = p.sorted[i];
    if (i > 0) {
      const int prev = p.sorted[i - 1];
      if (shards[prev].layer == shards[s].layer && shards[prev].kv_head == shards[s].kv_head) {
        return absl::InvalidArgumentError(
            absl::StrCat("shards ", prev, " and ", s, " are both ", p.Name(s)));
      }
      if (shards[prev].layer != shards[s].layer) ++p.num_layers;
    } else {
      p.num_layers = 1;
    }
    p.layer[s] = p.num_layers - 1;
  }
  if (static_cast<size_t>(p.num_layers) * static_cast<size_t>(p.num_nodes) > kMaxCells) {
    return absl::InvalidArgumentError(absl::StrCat(p.num_layers, " layers × ", p.num_nodes,
                                                   " nodes is over the planner's limit of ",
                                                   kMaxCells, " cells"));
  }
  p.layer_shards.resize(p.num_layers);
  for (int s : p.sorted) p.layer_shards[p.layer[s]].push_back(s);
  return p;
}

absl::Status NotEnoughMemory(const Problem& p) {
  return absl::ResourceExhaustedError(
      absl::StrCat("placement needs ", FormatBytes(p.total_mem), ", ",
                   FormatBytes(p.total_capacity), " available on ", p.accepting_nodes.size(),
                   " accepting nodes"));
}

// The accepting node with room for s on which s's layer would finish earliest (ties: s's current
// node, then the lowest index). quota_fraction >= 0 also keeps every node's memory use at most
// that fraction of its capacity. -1 when none qualifies.
int EarliestFinish(const Problem& p, const State& st, int s, double quota_fraction) {
  const int l = p.layer[s];
  int best = -1;
  double best_finish = std::numeric_limits<double>::infinity();
  for (int n : p.accepting_nodes) {
    if (p.mem[s] > st.Room(n)) continue;
    if (quota_fraction >= 0 && static_cast<double>(st.used(n)) + static_cast<double>(p.mem[s]) >
                                   quota_fraction * static_cast<double>(p.capacity[n])) {
      continue;
    }
    const double finish = st.TimeWith(l, n, s);
    if (finish < best_finish || (finish == best_finish && n == p.home[s])) {
      best = n;
      best_finish = finish;
    }
  }
  return best;
}

// Places unplaced shard s where no node has room for it: moves one placed shard t from a node b
// to a node c with room so that s fits on b, choosing the (b, t, c) whose step increase (t's
// move, plus s's layer finishing later on b) is smallest. Returns t, or -1 when no single move
// makes room.
int PlaceByEjection(const Problem& p, State& st, int s) {
  const int l = p.layer[s];
  double best_score = std::numeric_limits<double>::infinity();
  int best_b = -1, best_t = -1, best_c = -1;
  for (int t : p.sorted) {
    const int b = st.node_of(t);
    if (b < 0 || SatAdd(st.Room(b), p.mem[t]) < p.mem[s]) continue;
    const double place_cost = std::max(0.0, st.TimeWith(l, b, s) - st.LayerMax(l));
    for (int c : p.accepting_nodes) {
      if (c == b || p.mem[t] > st.Room(c)) continue;
      const double score = st.Move(t, c).prim + place_cost;
      if (score < best_score) {
        best_score = score;
        best_b = b;
        best_t = t;
        best_c = c;
      }
    }
  }
  if (best_t < 0) return -1;
  st.Assign(best_t, best_c);
  st.Assign(s, best_b);
  return best_t;
}

// LPT per layer, layers in order. With `quota`, while a node is used beyond (memory placed so
// far / all memory) of its capacity it takes nothing more if another node can, so early layers
// do not exhaust the fast nodes that later layers need as well. A shard that fits nowhere gets
// room by one ejection. Returns the shard that still fits nowhere, or -1.
int GreedyLpt(const Problem& p, State& st, bool quota, Clock::time_point give_up) {
  uint64_t placed = 0;
  for (int l = 0; l < p.num_layers; ++l) {
    std::vector<int> order = p.layer_shards[l];
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return p.scan[a] > p.scan[b]; });
    for (int s : order) placed += p.mem[s];
    const double fraction =
        p.total_mem > 0 ? static_cast<double>(placed) / static_cast<double>(p.total_mem) : 1.0;
    for (int s : order) {
      int n = quota ? EarliestFinish(p, st, s, fraction) : -1;
      if (n < 0) n = EarliestFinish(p, st, s, -1);
      if (n >= 0) {
        st.Assign(s, n);
      } else if (Clock::now() >= give_up || PlaceByEjection(p, st, s) < 0) {
        return s;
      }
    }
  }
  return -1;
}

// LPT over all shards at once, heaviest first. Layers do not interact except through memory,
// so without memory pressure this is the per-layer LPT; with it, the heavy shards of every
// layer get the fast nodes before light ones fill them. Returns the shard that fits nowhere
// even by ejection, or -1.
int GreedyLptGlobal(const Problem& p, State& st, Clock::time_point give_up) {
  std::vector<int> order = p.sorted;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p.scan[a] > p.scan[b]; });
  for (int s : order) {
    const int n = EarliestFinish(p, st, s, -1);
    if (n >= 0) {
      st.Assign(s, n);
    } else if (Clock::now() >= give_up || PlaceByEjection(p, st, s) < 0) {
      return s;
    }
  }
  return -1;
}

// The uniform baseline's rule (see PlanUniform). Returns the shard that fits nowhere, or -1.
int PlaceUniform(const Problem& p, State& st) {
  uint64_t heads = 0;
  for (uint32_t h : p.kv_head) heads = std::max<uint64_t>(heads, uint64_t{h} + 1);
  const uint64_t num_accepting = p.accepting_nodes.size();
  for (int s : p.sorted) {
    const uint64_t first = (uint64_t{p.layer_id[s]} * heads + p.kv_head[s]) % num_accepting;
    int chosen = -1;
    for (uint64_t i = 0; i < num_accepting && chosen < 0; ++i) {
      const int n = p.accepting_nodes[(first + i) % num_accepting];
      if (p.mem[s] <= st.Room(n)) chosen = n;
    }
    if (chosen < 0) return s;
    st.Assign(s, chosen);
  }
  return -1;
}

// Best-fit decreasing by memory, with ejection: the start that packs hardest. Returns the shard
// that fits nowhere, or -1.
int PackByMemory(const Problem& p, State& st, Clock::time_point give_up) {
  std::vector<int> order = p.sorted;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p.mem[a] > p.mem[b]; });
  for (int s : order) {
    int best = -1;
    for (int n : p.accepting_nodes) {
      if (p.mem[s] > st.Room(n)) continue;
      if (best < 0 || st.Room(n) < st.Room(best)) best = n;
    }
    if (best >= 0) {
      st.Assign(s, best);
    } else if (Clock::now() >= give_up || PlaceByEjection(p, st, s) < 0) {
      return s;
    }
  }
  return -1;
}

// Deterministic pseudo-random numbers for the perturbations (splitmix64: the same sequence on
// every platform, unlike the std distributions).
class SplitMix {
 public:
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  int Below(int n) { return static_cast<int>(Next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_ = 0x7a6e64656d;
};

// Perturbs a local optimum by ruin and recreate: two to four random shards (the first from the
// slowest node of a random layer) are taken out and put back heaviest first, each on the node
// where its layer finishes earliest or, half the time, on a random node with room. Works where
// memory is full and single moves are all blocked. False when a shard found no room.
bool Kick(const Problem& p, State& st, SplitMix& rng) {
  const int count = 2 + rng.Below(3);
  std::vector<int> out;
  const int l = rng.Below(p.num_layers);
  for (int s : p.layer_shards[l]) {
    if (st.Time(l, st.node_of(s)) >= st.LayerMax(l)) {
      out.push_back(s);
      break;
    }
  }
  while (static_cast<int>(out.size()) < count) {
    const int s = rng.Below(p.num_shards());
    if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
    if (static_cast<int>(out.size()) >= p.num_shards()) break;
  }
  for (int s : out) st.Assign(s, -1);
  std::stable_sort(out.begin(), out.end(), [&](int a, int b) { return p.scan[a] > p.scan[b]; });
  const int num_accepting = static_cast<int>(p.accepting_nodes.size());
  for (int s : out) {
    int n = -1;
    if (rng.Below(2) == 0) {
      const int first = rng.Below(num_accepting);
      for (int i = 0; i < num_accepting && n < 0; ++i) {
        const int candidate = p.accepting_nodes[(first + i) % num_accepting];
        if (p.mem[s] <= st.Room(candidate)) n = candidate;
      }
    } else {
      n = EarliestFinish(p, st, s, -1);
    }
    if (n >= 0) {
      st.Assign(s, n);
    } else if (PlaceByEjection(p, st, s) < 0) {
      return false;
    }
  }
  return true;
}

// Local search from several starts (global LPT, per-layer LPT with the memory quota, the
// uniform rule, memory-first packing), then iterated local search (kick, search again, keep the
// best) while time and patience last. The first start always completes; the later ones and the
// kicks run only while time is left. Once the uniform start has been searched, the result is
// never worse than PlanUniform.
absl::StatusOr<std::vector<int>> BalancedCore(const Problem& p, Clock::time_point deadline,
                                              int* steps) {
  *steps = 0;
  if (p.total_mem > p.total_capacity) return NotEnoughMemory(p);
  std::optional<State> best;
  int unplaced = -1;
  for (int start = 0; start < 4; ++start) {
    if (best.has_value() && Clock::now() >= deadline) break;
    State st(p);
    // A later start gives up at the deadline rather than finish a slow run of ejections.
    const Clock::time_point give_up = best.has_value() ? deadline : Clock::time_point::max();
    const int failed = start == 0   ? GreedyLptGlobal(p, st, give_up)
                       : start == 1 ? GreedyLpt(p, st, /*quota=*/true, give_up)
                       : start == 2 ? PlaceUniform(p, st)
                                    : PackByMemory(p, st, give_up);
    if (failed >= 0) {
      unplaced = failed;
      continue;
    }
    const int start_steps = Search(p, st, deadline).Run();
    if (!best.has_value() || st.Step() < best->Step()) {
      best = std::move(st);
      *steps = start_steps;
    }
  }
  if (!best.has_value()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot pack the shards: they need ", FormatBytes(p.total_mem), " of ",
        FormatBytes(p.total_capacity), " available on ", p.accepting_nodes.size(),
        " accepting nodes, but ", p.Name(unplaced), " of ", FormatBytes(p.mem[unplaced]),
        " fits on no node"));
  }
  if (p.num_shards() < 2 || p.accepting_nodes.size() < 2) return best->node_of();
  // Iterated local search: a kicked and re-searched placement replaces the current one when it
  // is no worse (so plateaus are crossed), and the best one seen is kept.
  SplitMix rng;
  State current = *best;
  for (int round = 0, stale = 0;
       round < kMaxKickRounds && stale < kKickPatience && Clock::now() < deadline; ++round) {
    State st = current;
    ++stale;
    if (!Kick(p, st, rng)) continue;
    const int round_steps = Search(p, st, deadline).Run();
    const double step = st.Step();
    if (step > current.Step() * (1 + kTolerance)) continue;
    if (step < best->Step() * (1 - kTolerance)) {
      best = st;
      *steps += round_steps;
      stale = 0;
    }
    current = std::move(st);
  }
  return best->node_of();
}

PlacementPlan MakePlan(std::span<const PlacementNode> nodes, std::span<const PlacementShard> shards,
                       std::vector<int> node_of, int steps) {
  PlacementPlan plan;
  plan.step_seconds = StepSeconds(nodes, shards, node_of);
  for (size_t s = 0; s < shards.size(); ++s) {
    if (node_of[s] == shards[s].current_node) continue;
    plan.changed = true;
    if (shards[s].current_node >= 0) {
      plan.moved_bytes = SatAdd(plan.moved_bytes, shards[s].memory_bytes);
      ++plan.moved_shards;
    }
  }
  plan.node_of = std::move(node_of);
  plan.search_steps = steps;
  return plan;
}

// --- Replan helpers ---

// Accepting nodes over capacity (their capacity shrank) shed their largest shards; those become
// forced moves.
void EvictOverCapacity(const Problem& p, State& st, std::vector<char>& forced) {
  for (int n : p.accepting_nodes) {
    if (st.used(n) <= p.capacity[n]) continue;
    std::vector<int> on_n;
    for (int s : p.sorted) {
      if (st.node_of(s) == n) on_n.push_back(s);
    }
    std::stable_sort(on_n.begin(), on_n.end(), [&](int a, int b) { return p.mem[a] > p.mem[b]; });
    for (int s : on_n) {
      if (st.used(n) <= p.capacity[n]) break;
      st.Assign(s, -1);
      forced[s] = 1;
    }
  }
}

// Places the forced shards heaviest first, each where its layer finishes earliest, or by one
// ejection (the ejected shard's move is then forced too). False when one cannot be placed.
bool PlaceForced(const Problem& p, State& st, std::vector<char>& forced) {
  std::vector<int> order;
  for (int s : p.sorted) {
    if (forced[s]) order.push_back(s);
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p.scan[a] > p.scan[b]; });
  for (int s : order) {
    const int n = EarliestFinish(p, st, s, -1);
    if (n >= 0) {
      st.Assign(s, n);
      continue;
    }
    const int ejected = PlaceByEjection(p, st, s);
    if (ejected < 0) return false;
    forced[ejected] = 1;
  }
  return true;
}

// Undoes optional moves that do not lower the step: a shard goes back to its home node when it
// has room, or two shards that traded nodes trade back.
void RevertUseless(const Problem& p, State& st) {
  const double tol = kTolerance * st.MaxLayerTime();
  std::vector<int> order;
  for (int s : p.sorted) {
    if (st.charge(s) > 0 && st.node_of(s) != p.home[s]) order.push_back(s);
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p.mem[a] > p.mem[b]; });
  for (int s : order) {
    const int a = st.node_of(s), h = p.home[s];
    if (a == h) continue;
    Candidate back = st.Move(s, h);
    if (st.Fits(back)) {
      if (back.prim <= tol) st.Apply(back);
      continue;
    }
    for (int t : order) {
      if (t == s || st.node_of(t) != h || p.home[t] != a) continue;
      Candidate both;
      if (p.layer[t] == p.layer[s]) {
        both = st.Swap(s, t);
      } else {
        both = back.Then(st.Move(t, a));
      }
      if (st.Fits(both) && both.prim <= tol) {
        st.Apply(both);
        break;
      }
    }
  }
}

// Interchangeable nodes (accepting, same rate and overhead) can trade a layer's bins without
// changing the step; gives each bin the node that already holds most of its bytes, layer by
// layer, where capacity allows.
void MatchLabels(const Problem& p, State& st) {
  std::vector<int> nodes = p.accepting_nodes;
  std::stable_sort(nodes.begin(), nodes.end(), [&](int a, int b) {
    return std::pair(p.sec_per_byte[a], p.overhead[a]) <
           std::pair(p.sec_per_byte[b], p.overhead[b]);
  });
  std::vector<int> target(p.num_nodes, -1);
  for (size_t begin = 0; begin < nodes.size();) {
    size_t end = begin + 1;
    while (end < nodes.size() && p.sec_per_byte[nodes[end]] == p.sec_per_byte[nodes[begin]] &&
           p.overhead[nodes[end]] == p.overhead[nodes[begin]]) {
      ++end;
    }
    const std::vector<int> members(nodes.begin() + begin, nodes.begin() + end);
    begin = end;
    if (members.size() < 2) continue;
    std::vector<char> in_class(p.num_nodes, 0);
    for (int n : members) in_class[n] = 1;
    for (int l = 0; l < p.num_layers; ++l) {
      // (bytes, bin node, home node) for shards of l that sit in this class and came from it.
      std::vector<std::tuple<uint64_t, int, int>> overlap;
      for (int s : p.layer_shards[l]) {
        const int n = st.node_of(s), h = p.home[s];
        if (st.charge(s) == 0 || !in_class[n] || h < 0 || !in_class[h]) continue;
        auto it = std::find_if(overlap.begin(), overlap.end(), [&](const auto& o) {
          return std::get<1>(o) == n && std::get<2>(o) == h;
        });
        if (it == overlap.end()) {
          overlap.emplace_back(p.mem[s], n, h);
        } else {
          std::get<0>(*it) += p.mem[s];
        }
      }
      std::stable_sort(overlap.begin(), overlap.end(), [](const auto& x, const auto& y) {
        return std::get<0>(x) > std::get<0>(y);
      });
      std::vector<char> taken(p.num_nodes, 0);
      for (int n : members) target[n] = -1;
      for (const auto& [bytes, bin, node] : overlap) {
        if (target[bin] >= 0 || taken[node]) continue;
        target[bin] = node;
        taken[node] = 1;
      }
      for (int n : members) {  // unmatched bins keep their node where it is still free
        if (target[n] < 0 && !taken[n]) {
          target[n] = n;
          taken[n] = 1;
        }
      }
      size_t next = 0;
      for (int n : members) {
        if (target[n] >= 0) continue;
        while (taken[members[next]]) ++next;
        target[n] = members[next];
        taken[members[next]] = 1;
      }
      std::vector<std::pair<int, int>> moved;  // (shard, old node)
      for (int s : p.layer_shards[l]) {
        const int n = st.node_of(s);
        if (in_class[n] && target[n] != n) moved.emplace_back(s, n);
      }
      if (moved.empty()) continue;
      for (const auto& [s, n] : moved) st.Assign(s, target[n]);
      bool fits = true;
      for (int n : members) fits = fits && st.used(n) <= p.capacity[n];
      if (!fits) {
        for (const auto& [s, n] : moved) st.Assign(s, n);
      }
    }
  }
}

}  // namespace

void PoolRatesByClass(std::span<PlacementNode> nodes, std::span<const int> class_of) {
  if (class_of.size() != nodes.size()) return;
  std::vector<int> classes;     // distinct class ids with a known rate
  std::vector<double> sum;      // Σ known rates per class
  std::vector<int> known;       // known rates per class
  for (size_t n = 0; n < nodes.size(); ++n) {
    const double rate = nodes[n].scan_bytes_per_second;
    if (class_of[n] < 0 || !(rate > 0) || !std::isfinite(rate)) continue;
    const auto it = std::find(classes.begin(), classes.end(), class_of[n]);
    if (it == classes.end()) {
      classes.push_back(class_of[n]);
      sum.push_back(rate);
      known.push_back(1);
    } else {
      sum[it - classes.begin()] += rate;
      ++known[it - classes.begin()];
    }
  }
  for (size_t n = 0; n < nodes.size(); ++n) {
    const auto it = std::find(classes.begin(), classes.end(), class_of[n]);
    if (class_of[n] < 0 || it == classes.end()) continue;
    const size_t c = static_cast<size_t>(it - classes.begin());
    nodes[n].scan_bytes_per_second = sum[c] / known[c];
  }
}

double StepSeconds(std::span<const PlacementNode> nodes, std::span<const PlacementShard> shards,
                   std::span<const int> node_of) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  if (node_of.size() != shards.size()) return kInf;
  const int num_nodes = static_cast<int>(nodes.size());
  std::vector<int> order;
  for (size_t s = 0; s < shards.size(); ++s) {
    if (node_of[s] < -1 || node_of[s] >= num_nodes) return kInf;
    if (node_of[s] >= 0) order.push_back(static_cast<int>(s));
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return shards[a].layer < shards[b].layer; });
  const std::vector<double> sec_per_byte = SecondsPerByte(nodes);
  std::vector<double> time(num_nodes, 0.0);
  std::vector<char> owns(num_nodes, 0);
  std::vector<int> touched;
  double step = 0;
  for (size_t i = 0; i < order.size();) {
    const uint32_t layer = shards[order[i]].layer;
    for (; i < order.size() && shards[order[i]].layer == layer; ++i) {
      const int n = node_of[order[i]];
      if (!owns[n]) {
        owns[n] = 1;
        time[n] = nodes[n].attend_overhead_seconds;
        touched.push_back(n);
      }
      time[n] += shards[order[i]].scan_bytes * sec_per_byte[n];
    }
    double slowest = 0;
    for (int n : touched) {
      slowest = std::max(slowest, time[n]);
      owns[n] = 0;
    }
    touched.clear();
    step += slowest;
  }
  return step;
}

absl::StatusOr<PlacementPlan> PlanBalanced(std::span<const PlacementNode> nodes,
                                           std::span<const PlacementShard> shards,
                                           const PlacementOptions& options) {
  const Clock::time_point deadline =
      Clock::now() + std::max(options.time_budget, std::chrono::microseconds(0));
  TANDEM_ASSIGN_OR_RETURN(const Problem p, BuildProblem(nodes, shards));
  int steps = 0;
  TANDEM_ASSIGN_OR_RETURN(std::vector<int> node_of, BalancedCore(p, deadline, &steps));
  return MakePlan(nodes, shards, std::move(node_of), steps);
}

absl::StatusOr<PlacementPlan> PlanUniform(std::span<const PlacementNode> nodes,
                                          std::span<const PlacementShard> shards) {
  TANDEM_ASSIGN_OR_RETURN(const Problem p, BuildProblem(nodes, shards));
  if (p.total_mem > p.total_capacity) return NotEnoughMemory(p);
  State st(p);
  const int s = PlaceUniform(p, st);
  if (s >= 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "uniform placement: ", p.Name(s), " of ", FormatBytes(p.mem[s]),
        " fits on no accepting node (the shards need ", FormatBytes(p.total_mem), ", ",
        FormatBytes(p.total_capacity), " available on ", p.accepting_nodes.size(),
        " accepting nodes)"));
  }
  return MakePlan(nodes, shards, st.node_of(), 0);
}

absl::StatusOr<PlacementPlan> Replan(std::span<const PlacementNode> nodes,
                                     std::span<const PlacementShard> shards,
                                     const PlacementOptions& options) {
  const Clock::time_point start = Clock::now();
  const auto budget = std::max(options.time_budget, std::chrono::microseconds(0));
  TANDEM_ASSIGN_OR_RETURN(const Problem p, BuildProblem(nodes, shards));
  const double gain = options.min_relative_gain;
  if (std::isnan(gain) || gain < 0) {
    return absl::InvalidArgumentError(absl::StrCat("min_relative_gain must be >= 0, got ", gain));
  }
  for (const auto& [name, value] : {std::pair{"min_gain_seconds", options.min_gain_seconds},
                                    std::pair{"remaining_steps", options.remaining_steps},
                                    std::pair{"move_bytes_per_second",
                                              options.move_bytes_per_second}}) {
    if (!std::isfinite(value) || value < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " must be finite and >= 0, got ", value));
    }
  }
  if (p.total_mem > p.total_capacity) return NotEnoughMemory(p);

  // 1. Forced moves.
  State st(p);
  std::vector<char> forced(p.num_shards(), 0);
  for (int s = 0; s < p.num_shards(); ++s) {
    const int h = p.home[s];
    if (h >= 0 && p.accepting[h]) {
      st.Assign(s, h);
    } else {
      forced[s] = 1;
    }
  }
  EvictOverCapacity(p, st, forced);
  if (!PlaceForced(p, st, forced)) {
    // Only a reshuffle makes room: the from-scratch plan is the answer whatever it moves.
    int steps = 0;
    TANDEM_ASSIGN_OR_RETURN(std::vector<int> node_of, BalancedCore(p, start + budget, &steps));
    return MakePlan(nodes, shards, std::move(node_of), steps);
  }
  const std::vector<int> forced_only = st.node_of();
  const double forced_step = st.Step();
  if (std::isinf(gain)) return MakePlan(nodes, shards, forced_only, 0);  // forced moves only
  std::vector<uint64_t> charge(p.num_shards(), 0);
  for (int s = 0; s < p.num_shards(); ++s) charge[s] = forced[s] ? 0 : p.mem[s];

  // 2. Local search from there.
  st.SetCharges(charge, options.max_moved_bytes);
  const int local_steps = Search(p, st, start + budget / 2).Run();
  RevertUseless(p, st);
  std::vector<int> chosen = st.node_of();
  double chosen_step = st.Step();
  int chosen_steps = local_steps;

  // 3. The plan from scratch, relabelled to keep what it can where it is (pointless when no
  // optional byte may move).
  int scratch_steps = 0;
  absl::StatusOr<std::vector<int>> scratch = absl::CancelledError("no optional moves allowed");
  if (options.max_moved_bytes > 0) scratch = BalancedCore(p, start + budget, &scratch_steps);
  if (scratch.ok()) {
    State alt(p);
    alt.SetCharges(charge, std::numeric_limits<uint64_t>::max());
    for (int s = 0; s < p.num_shards(); ++s) alt.Assign(s, (*scratch)[s]);
    MatchLabels(p, alt);
    RevertUseless(p, alt);
    const double alt_step = alt.Step();
    if (alt.optional_bytes() <= options.max_moved_bytes && alt_step < chosen_step &&
        alt_step <= chosen_step * (1 - gain)) {
      chosen = alt.node_of();
      chosen_step = alt_step;
      chosen_steps = scratch_steps;
    }
  }

  // 4. Adopt only a worthwhile gain, one that repays its copy.
  const double step_gain = forced_step - chosen_step;
  bool adopt = step_gain > 0 && step_gain >= gain * forced_step &&
               step_gain >= options.min_gain_seconds;
  if (adopt && options.move_bytes_per_second > 0) {
    uint64_t optional_bytes = 0;
    for (int s = 0; s < p.num_shards(); ++s) {
      if (!forced[s] && chosen[s] != forced_only[s]) optional_bytes += p.mem[s];
    }
    const double copy_seconds = static_cast<double>(optional_bytes) / options.move_bytes_per_second;
    adopt = step_gain * options.remaining_steps >= copy_seconds;
  }
  if (!adopt) return MakePlan(nodes, shards, forced_only, 0);
  return MakePlan(nodes, shards, std::move(chosen), chosen_steps);
}

}  // namespace tandem::gpu_worker
