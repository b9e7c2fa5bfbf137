// Internal to placement_planner.cc: the validated problem in dense form, a placement with
// per-(layer, node) totals, and the local search over it. See placement_planner.h for the
// cost model.
//
// Not thread-safe: one State and its Search belong to one call.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tandem::gpu_worker::placement_internal {

using Clock = std::chrono::steady_clock;

// Relative to the slowest layer's time: changes of the objective below this are rounding noise.
inline constexpr double kTolerance = 1e-9;
// Memory-blocked moves kept per layer, and how many of all of them seed one cross-layer search.
inline constexpr size_t kBlockedPerLayer = 4;
inline constexpr size_t kCrossSeeds = 16;
inline constexpr int kMaxSearchSteps = 1 << 20;

// Layers are renumbered 0..num_layers-1 in ascending order of their value.
struct Problem {
  int num_nodes = 0;
  int num_layers = 0;
  std::vector<double> sec_per_byte;            // [nodes] 1 / scan rate
  std::vector<double> overhead;                // [nodes] seconds per Attend call
  std::vector<uint64_t> capacity;              // [nodes] bytes; 0 on non-accepting nodes
  std::vector<char> accepting;                 // [nodes]
  std::vector<int> accepting_nodes;            // ascending node indices
  std::vector<int> layer;                      // [shards] dense layer index
  std::vector<std::vector<int>> layer_shards;  // [layers] shard indices by ascending kv_head
  std::vector<int> sorted;                     // shard indices by (layer, kv_head)
  std::vector<double> scan;                    // [shards] bytes read per Attend
  std::vector<uint64_t> mem;                   // [shards] bytes held
  std::vector<int> home;                       // [shards] current_node, -1 = none
  std::vector<uint32_t> layer_id, kv_head;     // [shards] as given, for messages
  uint64_t total_mem = 0;                      // Σ mem (checked not to overflow)
  uint64_t total_capacity = 0;                 // Σ capacity of accepting nodes, saturating

  int num_shards() const { return static_cast<int>(scan.size()); }
  double Cost(int s, int n) const { return scan[s] * sec_per_byte[n]; }
  std::string Name(int s) const {
    return absl::StrCat("shard (layer ", layer_id[s], ", kv_head ", kv_head[s], ")");
  }
};

// Up to three shard moves taken together (a move, a swap, a move that another layer's move or
// swap makes room for), with their effect on the objective.
struct Candidate {
  static constexpr int kMaxMoves = 3;
  int moves = 0;  // 0 = none
  int shard[kMaxMoves] = {-1, -1, -1};
  int dst[kMaxMoves] = {-1, -1, -1};
  double prim = 0;   // change of the step (seconds)
  double sq = 0;     // change of Σ time² over the touched layers (tie-breaker)
  double bytes = 0;  // change of the optional moved bytes (Replan)

  // Appends `other`'s moves; its layers must differ from this one's, so the changes add.
  Candidate Then(const Candidate& other) const {
    Candidate c = *this;
    for (int i = 0; i < other.moves; ++i) {
      c.shard[c.moves] = other.shard[i];
      c.dst[c.moves++] = other.dst[i];
    }
    c.prim += other.prim;
    c.sq += other.sq;
    return c;
  }
};

// A placement (possibly partial) with per-(layer, node) totals kept current.
// NOTE: a layer's totals are recomputed from its shards on every change (O(nodes + heads)), so
// no rounding drift accumulates over thousands of moves.
class State {
 public:
  explicit State(const Problem& p)
      : p_(&p),
        node_of_(p.num_shards(), -1),
        used_(p.num_nodes, 0),
        load_(static_cast<size_t>(p.num_layers) * p.num_nodes, 0.0),
        count_(load_.size(), 0),
        top_(p.num_layers),
        charge_(p.num_shards(), 0) {}

  const std::vector<int>& node_of() const { return node_of_; }
  int node_of(int s) const { return node_of_[s]; }
  uint64_t used(int n) const { return used_[n]; }
  uint64_t Room(int n) const { return p_->capacity[n] > used_[n] ? p_->capacity[n] - used_[n] : 0; }
  int Count(int l, int n) const { return count_[Cell(l, n)]; }
  // Seconds node n spends on layer l: overhead + scans, 0 when it owns none of l.
  double Time(int l, int n) const {
    const size_t i = Cell(l, n);
    return count_[i] > 0 ? p_->overhead[n] + load_[i] : 0.0;
  }
  // Layer l's time on n once s (not yet there) joins it.
  double TimeWith(int l, int n, int s) const {
    return (Count(l, n) > 0 ? Time(l, n) : p_->overhead[n]) + p_->Cost(s, n);
  }
  double LayerMax(int l) const { return top_[l].time[0]; }
  double Step() const {
    double step = 0;
    for (int l = 0; l < p_->num_layers; ++l) step += LayerMax(l);
    return step;
  }
  double MaxLayerTime() const {
    double m = 0;
    for (int l = 0; l < p_->num_layers; ++l) m = std::max(m, LayerMax(l));
    return m;
  }

  // Moves s to n (-1 = unplace). Capacity is not checked here.
  void Assign(int s, int n) {
    const int old = node_of_[s];
    if (old == n) return;
    optional_bytes_ -= MovedCost(s, old);
    if (old >= 0) used_[old] -= p_->mem[s];
    if (n >= 0) used_[n] += p_->mem[s];
    node_of_[s] = n;
    optional_bytes_ += MovedCost(s, n);
    Refresh(p_->layer[s]);
  }
  void Apply(const Candidate& c) {
    for (int i = 0; i < c.moves; ++i) Assign(c.shard[i], c.dst[i]);
  }

  // Replan: shard s costs charge[s] bytes while it is off its home node; optional moves may
  // total at most `limit` bytes.
  void SetCharges(std::vector<uint64_t> charge, uint64_t limit) {
    charge_ = std::move(charge);
    limit_ = limit;
    optional_bytes_ = 0;
    for (int s = 0; s < p_->num_shards(); ++s) optional_bytes_ += MovedCost(s, node_of_[s]);
  }
  uint64_t optional_bytes() const { return optional_bytes_; }
  uint64_t charge(int s) const { return charge_[s]; }

  // s (placed) moves to b.
  Candidate Move(int s, int b) const {
    const int l = p_->layer[s];
    const int a = node_of_[s];
    const double ta = Time(l, a), tb = Time(l, b);
    const double na = Count(l, a) > 1 ? ta - p_->Cost(s, a) : 0.0;
    const double nb = TimeWith(l, b, s);
    Candidate c;
    c.moves = 1;
    c.shard[0] = s;
    c.dst[0] = b;
    c.prim = std::max({OthersMax(l, a, b), na, nb}) - LayerMax(l);
    c.sq = na * na + nb * nb - ta * ta - tb * tb;
    return c;
  }
  // s and t of one layer, on different nodes, trade places.
  Candidate Swap(int s, int t) const {
    const int l = p_->layer[s];
    const int a = node_of_[s], b = node_of_[t];
    const double ta = Time(l, a), tb = Time(l, b);
    const double na = ta - p_->Cost(s, a) + p_->Cost(t, a);
    const double nb = tb - p_->Cost(t, b) + p_->Cost(s, b);
    Candidate c;
    c.moves = 2;
    c.shard[0] = s;
    c.dst[0] = b;
    c.shard[1] = t;
    c.dst[1] = a;
    c.prim = std::max({OthersMax(l, a, b), na, nb}) - LayerMax(l);
    c.sq = na * na + nb * nb - ta * ta - tb * tb;
    return c;
  }

  // Whether every node stays within capacity after c.
  bool Fits(const Candidate& c) const {
    constexpr int kMaxNodes = 2 * Candidate::kMaxMoves;
    int node[kMaxNodes];
    uint64_t in[kMaxNodes] = {}, out[kMaxNodes] = {};
    int k = 0;
    auto slot = [&](int n) {
      int i = 0;
      while (i < k && node[i] != n) ++i;
      if (i == k) node[k++] = n;
      return i;
    };
    for (int m = 0; m < c.moves; ++m) {
      out[slot(node_of_[c.shard[m]])] += p_->mem[c.shard[m]];
      in[slot(c.dst[m])] += p_->mem[c.shard[m]];
    }
    for (int i = 0; i < k; ++i) {
      if (in[i] > out[i] && in[i] - out[i] > Room(node[i])) return false;
    }
    return true;
  }
  // Whether c keeps the optional moved bytes within the limit; sets c->bytes.
  bool WithinBudget(Candidate* c) const {
    uint64_t before = 0, after = 0;
    for (int m = 0; m < c->moves; ++m) {
      before += MovedCost(c->shard[m], node_of_[c->shard[m]]);
      after += MovedCost(c->shard[m], c->dst[m]);
    }
    c->bytes = static_cast<double>(after) - static_cast<double>(before);
    return optional_bytes_ - before + after <= limit_;
  }

 private:
  struct Top3 {
    double time[3] = {0, 0, 0};
    int node[3] = {-1, -1, -1};
  };

  size_t Cell(int l, int n) const { return static_cast<size_t>(l) * p_->num_nodes + n; }
  uint64_t MovedCost(int s, int n) const { return (n >= 0 && n != p_->home[s]) ? charge_[s] : 0; }
  // The largest time in layer l among nodes other than a and b.
  double OthersMax(int l, int a, int b) const {
    const Top3& top = top_[l];
    for (int i = 0; i < 3; ++i) {
      if (top.node[i] != a && top.node[i] != b) return top.time[i];
    }
    return 0.0;
  }
  void Refresh(int l) {
    const size_t base = Cell(l, 0);
    std::fill_n(load_.begin() + base, p_->num_nodes, 0.0);
    std::fill_n(count_.begin() + base, p_->num_nodes, 0);
    for (int s : p_->layer_shards[l]) {
      const int n = node_of_[s];
      if (n < 0) continue;
      load_[base + n] += p_->Cost(s, n);
      ++count_[base + n];
    }
    Top3 top;
    for (int n = 0; n < p_->num_nodes; ++n) {
      const double t = Time(l, n);
      if (t <= top.time[2]) continue;
      int i = 2;
      while (i > 0 && t > top.time[i - 1]) {
        top.time[i] = top.time[i - 1];
        top.node[i] = top.node[i - 1];
        --i;
      }
      top.time[i] = t;
      top.node[i] = n;
    }
    top_[l] = top;
  }

  const Problem* p_;
  std::vector<int> node_of_;      // [shards]
  std::vector<uint64_t> used_;    // [nodes] bytes
  std::vector<double> load_;      // [layers × nodes] seconds of scanning, without overhead
  std::vector<int> count_;        // [layers × nodes] shards
  std::vector<Top3> top_;         // [layers] the three slowest nodes
  std::vector<uint64_t> charge_;  // [shards] bytes counted while s is off its home node
  uint64_t limit_ = std::numeric_limits<uint64_t>::max();
  uint64_t optional_bytes_ = 0;
};

// Local search: repeatedly applies the best improving candidate. Improving is lexicographic:
// the step first, then Σ time² for candidates that move load off a node at its layer's maximum
// without raising it (that breaks ties at the maximum one node at a time). Candidates are
// single moves and swaps within a layer; when none is left but memory blocks improving moves
// (s: a → b, b full), a move or swap in another layer that frees room on b is added to one.
//
// Each layer's best candidate is cached. A move changes only its layers' times, and memory
// only on its nodes, so a cache goes stale when its layer changed, when its candidate no longer
// fits (checked before applying), or when memory was freed on a node that one of its improving
// candidates was blocked on (tracked per (layer, node)).
class Search {
 public:
  Search(const Problem& p, State& st, Clock::time_point deadline)
      : p_(p),
        st_(st),
        deadline_(deadline),
        best_(p.num_layers),
        blocked_(p.num_layers),
        fresh_(p.num_layers, 0),
        blocked_on_(static_cast<size_t>(p.num_layers) * p.num_nodes, 0) {
    const double scale = st.MaxLayerTime();
    tol_p_ = kTolerance * scale;
    tol_s_ = kTolerance * scale * scale;
  }

  // Returns the number of candidates applied.
  int Run() {
    int steps = 0;
    while (steps < kMaxSearchSteps && Clock::now() < deadline_) {
      int pick = -1;
      for (int l = 0; l < p_.num_layers; ++l) {
        if (!fresh_[l]) ScanLayer(l);
        if (best_[l].moves > 0 && (pick < 0 || Better(best_[l], best_[pick]))) pick = l;
      }
      Candidate c;
      if (pick >= 0) {
        c = best_[pick];
        if (!st_.Fits(c) || !st_.WithinBudget(&c)) {  // memory or bytes were used up since
          fresh_[pick] = 0;
          continue;
        }
      } else {
        c = BestCrossLayer();
        if (c.moves == 0) break;
      }
      ApplyAndInvalidate(c);
      ++steps;
    }
    return steps;
  }

 private:
  bool Improves(const Candidate& c) const {
    return c.prim < -tol_p_ || (c.prim <= tol_p_ && c.sq < -tol_s_);
  }
  // Step gains before tie-breaker gains; free moves before ones that cost bytes; then the
  // largest gain (per byte when bytes are spent).
  int Tier(const Candidate& c) const {
    const bool step_gain = c.prim < -tol_p_;
    const bool free = c.bytes <= 0;
    return step_gain ? (free ? 0 : 1) : (free ? 2 : 3);
  }
  double Value(const Candidate& c, int tier) const {
    switch (tier) {
      case 0:
        return -c.prim;
      case 1:
        return -c.prim / c.bytes;
      case 2:
        return -c.sq;
      default:
        return -c.sq / c.bytes;
    }
  }
  bool Better(const Candidate& a, const Candidate& b) const {
    if (b.moves == 0) return a.moves > 0;
    if (a.moves == 0) return false;
    const int ta = Tier(a), tb = Tier(b);
    if (ta != tb) return ta < tb;
    return Value(a, ta) > Value(b, tb);
  }
  static bool Before(const Candidate& x, const Candidate& y) {
    return x.prim < y.prim || (x.prim == y.prim && x.sq < y.sq);
  }

  // Caches layer l's best feasible improving move or swap, and its best few improving single
  // moves that only lack memory on their destination (seeds of the cross-layer search).
  // Only load leaving a node at the layer's maximum can improve, which prunes most pairs.
  void ScanLayer(int l) {
    Candidate best;
    std::vector<Candidate>& blocked = blocked_[l];
    blocked.clear();
    char* blocked_on = &blocked_on_[static_cast<size_t>(l) * p_.num_nodes];
    std::fill_n(blocked_on, p_.num_nodes, 0);
    const double max = st_.LayerMax(l);
    auto at_max = [&](int n) { return st_.Time(l, n) >= max - tol_p_; };
    const std::vector<int>& shards = p_.layer_shards[l];
    for (int s : shards) {
      const int a = st_.node_of(s);
      if (!at_max(a)) continue;
      for (int b : p_.accepting_nodes) {
        if (b == a || st_.TimeWith(l, b, s) > max + tol_p_) continue;
        Candidate c = st_.Move(s, b);
        if (!Improves(c) || !st_.WithinBudget(&c)) continue;
        if (!st_.Fits(c)) {
          blocked_on[b] = 1;
          blocked.push_back(c);
          continue;
        }
        if (Better(c, best)) best = c;
      }
    }
    for (size_t i = 0; i < shards.size(); ++i) {
      const int a = st_.node_of(shards[i]);
      const bool a_max = at_max(a);
      for (size_t j = i + 1; j < shards.size(); ++j) {
        const int b = st_.node_of(shards[j]);
        if (a == b || (!a_max && !at_max(b))) continue;
        Candidate c = st_.Swap(shards[i], shards[j]);
        if (!Improves(c) || !st_.WithinBudget(&c)) continue;
        if (!st_.Fits(c)) {
          blocked_on[a] = blocked_on[b] = 1;
          continue;
        }
        if (Better(c, best)) best = c;
      }
    }
    const size_t keep = std::min(kBlockedPerLayer, blocked.size());
    std::partial_sort(blocked.begin(), blocked.begin() + keep, blocked.end(), Before);
    blocked.resize(keep);
    best_[l] = best;
    fresh_[l] = 1;
  }

  // For the best blocked moves (s: a → b, b full): a shard t of another layer leaves b, by a
  // move to any node c or a swap with a shard u of its layer on c. Called with every cache
  // fresh.
  Candidate BestCrossLayer() {
    std::vector<Candidate> seeds;
    for (int l = 0; l < p_.num_layers; ++l) {
      seeds.insert(seeds.end(), blocked_[l].begin(), blocked_[l].end());
    }
    if (seeds.empty()) return {};
    const size_t keep = std::min(kCrossSeeds, seeds.size());
    std::partial_sort(seeds.begin(), seeds.begin() + keep, seeds.end(), Before);
    seeds.resize(keep);
    std::vector<std::vector<int>> on_node(p_.num_nodes);
    for (int s : p_.sorted) on_node[st_.node_of(s)].push_back(s);
    Candidate best;
    auto consider = [&](Candidate c) {
      if (Improves(c) && st_.WithinBudget(&c) && st_.Fits(c) && Better(c, best)) best = c;
    };
    for (const Candidate& first : seeds) {
      if (Clock::now() >= deadline_) break;
      const int l = p_.layer[first.shard[0]];
      const int b = first.dst[0];
      for (int t : on_node[b]) {
        const int lt = p_.layer[t];
        if (lt == l) continue;
        // t's layer ends no sooner than t's new node does; skip c that cannot pay for it.
        const double slack = tol_p_ - first.prim + st_.LayerMax(lt);
        for (int c : p_.accepting_nodes) {
          if (c == b || st_.TimeWith(lt, c, t) > slack) continue;
          consider(first.Then(st_.Move(t, c)));
        }
        for (int u : p_.layer_shards[lt]) {
          if (st_.node_of(u) != b && p_.mem[u] < p_.mem[t]) consider(first.Then(st_.Swap(t, u)));
        }
      }
    }
    return best;
  }

  void ApplyAndInvalidate(const Candidate& c) {
    int src[Candidate::kMaxMoves];
    for (int m = 0; m < c.moves; ++m) src[m] = st_.node_of(c.shard[m]);
    const uint64_t bytes_before = st_.optional_bytes();
    st_.Apply(c);
    for (int m = 0; m < c.moves; ++m) fresh_[p_.layer[c.shard[m]]] = 0;
    // Nodes whose memory use dropped: candidates blocked on them may fit now.
    std::vector<int> freed;
    for (int m = 0; m < c.moves; ++m) {
      const int n = src[m];
      uint64_t out = 0, in = 0;
      for (int k = 0; k < c.moves; ++k) {
        if (src[k] == n) out += p_.mem[c.shard[k]];
        if (c.dst[k] == n) in += p_.mem[c.shard[k]];
      }
      if (out > in) freed.push_back(n);
    }
    // Fewer optional bytes: candidates over the byte limit may fit now.
    const bool budget_freed = st_.optional_bytes() < bytes_before;
    for (int l = 0; l < p_.num_layers; ++l) {
      const char* blocked_on = &blocked_on_[static_cast<size_t>(l) * p_.num_nodes];
      bool stale = budget_freed;
      for (int n : freed) stale = stale || blocked_on[n];
      if (stale) fresh_[l] = 0;
    }
  }

  const Problem& p_;
  State& st_;
  const Clock::time_point deadline_;
  double tol_p_ = 0;                             // seconds
  double tol_s_ = 0;                             // seconds²
  std::vector<Candidate> best_;                  // [layers] cached best candidate
  std::vector<std::vector<Candidate>> blocked_;  // [layers] cached memory-blocked candidates
  std::vector<char> fresh_;                      // [layers] caches valid
  std::vector<char> blocked_on_;                 // [layers × nodes] an improving one lacked room
};

}  // namespace tandem::gpu_worker::placement_internal
