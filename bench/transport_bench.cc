// tandem-transport-bench: the GPU worker <-> CPU attention node transport, through RemoteKv as
// the engine uses it.
//
// (1) Per-layer Attend round trip (StartAttend + FinishAttend) at batch 1, one decode token,
//     Llama-3-8B geometry (32 query heads, 8 kv heads, head_dim 128, bf16 KV), β = 0, over a
//     small held context (--contexts entries per kv head) so the transport dominates:
//       shm-embedded   shared memory to the in-process node
//       grpc-inproc    gRPC in-process channel to the same node
//       grpc-tcp       gRPC over TCP to a tandem-cpu-attention process on localhost
//       shm-process    shared memory to that same process
//     median, p99 and mean over --calls timed calls (after --warmup). Two floors come with them:
//       shm-echo       the channel alone between two threads, Attend-sized messages copied
//       node-direct    CpuAttentionNode::AttendRaw in the calling thread (compute, no transport)
// (2) Append throughput: --append_mib MiB of K + V + MAW appended (4096-token evictions over
//     the 32 layers) over shm and over gRPC, to the embedded node and to the process; GB/s =
//     appended bytes / wall time of the Append calls. β is huge here so no selected copies are
//     made (the store only). node-direct: AppendKvRaw on the embedded node from this thread,
//     the store's copy alone. Each node is warmed by one untimed append of the same size; before
//     that, with --append_cold, the two embedded rows append into blocks never written
//     (node-direct-cold, shm-embedded-cold; each session stays open to the end so the next
//     row's blocks are fresh too), as a settle into a node that has not held that much does.
//
// The node process comes from --cpu_attention_bin (started here on a free port, stopped at the
// end) or --cpu_nodes=host:port (already running, on this host for shm). Without either, the
// process rows are skipped. Prints one JSON object per line, then a table.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "parse_flags.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tandem/common/bf16.h"
#include "tandem/common/byte_size.h"
#include "tandem/cpu_attention/shm_channel.h"
#include "tandem/gpu_worker/node_pool.h"
#include "tandem/gpu_worker/remote_kv.h"

ABSL_FLAG(std::vector<std::string>, contexts, std::vector<std::string>({"64", "4096"}),
          "held entries per kv head for the round-trip rows");
ABSL_FLAG(uint32_t, calls, 2000, "timed Attend calls per row");
ABSL_FLAG(uint32_t, warmup, 200, "untimed Attend calls before each row");
ABSL_FLAG(uint64_t, append_mib, 1024, "MiB of K + V + MAW per append row (0 = skip)");
ABSL_FLAG(std::string, cpu_attention_bin, "", "tandem-cpu-attention to start on localhost");
ABSL_FLAG(std::string, cpu_nodes, "", "host:port of a running node instead");
ABSL_FLAG(uint32_t, threads, 0, "attention threads of the nodes; 0 = every usable core");
ABSL_FLAG(uint32_t, spin_us, 10, "shm spin before sleeping, both sides");
ABSL_FLAG(uint64_t, pool_mib, 4096, "node pool MiB (must hold 3 x --append_mib with --append_cold)");
ABSL_FLAG(uint64_t, append_chunk_mib, 8, "MiB per shm Append chunk");
ABSL_FLAG(int64_t, append_tokens, 4096,
          "tokens per (layer) Append call: a worker's settle slice or eviction (1..65536)");
ABSL_FLAG(tandem::ByteSize, node_warm_reserve, tandem::ByteSize{512ull << 20},
          "embedded node: free block memory kept faulted in (NodeOptions::warm_reserve_bytes)");
ABSL_FLAG(bool, node_huge_pages, true,
          "embedded node: KV blocks on transparent huge pages (NodeOptions::huge_pages)");
ABSL_FLAG(bool, append_cold, true,
          "also time appends into never-written blocks (the pool must hold 3 x --append_mib)");

namespace {

namespace gw = tandem::gpu_worker;
using Clock = std::chrono::steady_clock;

constexpr int64_t kLayers = 32, kQHeads = 32, kKvHeads = 8, kDim = 128;

// A tandem-cpu-attention child on a free localhost port.
class NodeProcess {
 public:
  static std::unique_ptr<NodeProcess> Start(const std::string& bin, uint64_t pool_mib,
                                            uint32_t threads) {
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0) return nullptr;
    std::vector<std::string> argv = {bin, "--address=127.0.0.1:0",
                                     absl::StrCat("--pool_bytes=", pool_mib, "MiB"),
                                     absl::StrCat("--threads=", threads), "--log_level=warn"};
    std::vector<char*> args;
    for (std::string& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    const pid_t pid = fork();
    if (pid < 0) return nullptr;
    if (pid == 0) {
      dup2(out[1], STDOUT_FILENO);
      execv(args[0], args.data());
      _exit(127);
    }
    close(out[1]);
    auto node = std::unique_ptr<NodeProcess>(new NodeProcess());
    node->pid_ = pid;
    std::string text;
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    while (Clock::now() < deadline) {
      pollfd p{out[0], POLLIN, 0};
      if (poll(&p, 1, 1000) <= 0) continue;
      char buf[256];
      const ssize_t n = read(out[0], buf, sizeof(buf));
      if (n <= 0) break;
      text.append(buf, static_cast<size_t>(n));
      const size_t at = text.find("LISTENING ");
      const size_t eol = at == std::string::npos ? at : text.find('\n', at);
      if (eol != std::string::npos &&
          absl::SimpleAtoi(text.substr(at + 10, eol - at - 10), &node->port_)) {
        break;
      }
    }
    close(out[0]);
    if (node->port_ == 0) return nullptr;
    return node;
  }
  ~NodeProcess() {
    kill(pid_, SIGTERM);
    waitpid(pid_, nullptr, 0);
  }
  int port() const { return port_; }

 private:
  NodeProcess() = default;
  pid_t pid_ = -1;
  int port_ = 0;
};

gw::RemoteKvOptions Options(const std::string& id, gw::NodeTransport transport, float beta) {
  gw::RemoteKvOptions o;
  o.session_id = id;
  o.num_layers = kLayers;
  o.num_q_heads = kQHeads;
  o.num_kv_heads = kKvHeads;
  o.head_dim = kDim;
  o.kv_dtype = gw::DType::kBF16;
  o.beta = beta;
  o.block_tokens = 64;
  o.transport = transport;
  o.attend_deadline_ms = 10000;
  o.control_deadline_ms = 120000;
  o.shm_spin_us = absl::GetFlag(FLAGS_spin_us);
  o.shm_append_chunk_bytes = absl::GetFlag(FLAGS_append_chunk_mib) << 20;
  o.shm_request_bytes =
      std::max<uint64_t>(o.shm_request_bytes, 2 * o.shm_append_chunk_bytes + (1 << 20));
  return o;
}

// Head-major random KV of one eviction: k, v [H_kv, n, D] bf16, maw [H_kv, n].
struct Eviction {
  int64_t tokens;
  std::vector<uint16_t> k, v;
  std::vector<float> maw;
  explicit Eviction(int64_t n)
      : tokens(n), k(kKvHeads * n * kDim), v(k.size()), maw(kKvHeads * n, 0.01f) {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = tandem::FloatToBf16(normal(rng));
      v[i] = tandem::FloatToBf16(normal(rng));
    }
  }
  uint64_t bytes() const { return (k.size() + v.size()) * 2 + maw.size() * 4; }
};

struct RoundTrip {
  double median_us = 0, p99_us = 0, mean_us = 0;
  uint64_t degraded = 0;
  uint64_t shm_attends = 0;
};

RoundTrip Summarize(std::vector<double> us);

absl::StatusOr<RoundTrip> MeasureRoundTrip(gw::NodePool& pool, gw::NodeTransport transport,
                                           const std::string& id, int64_t context) {
  auto kv = gw::RemoteKv::Open(pool, Options(id, transport, /*beta=*/0.0f));
  if (!kv.ok()) return kv.status();
  const Eviction e(context);
  absl::Status s = (*kv)->Append(0, e.k.data(), e.v.data(), e.maw.data(), context, 1024);
  if (!s.ok()) return s;
  std::vector<float> q(kQHeads * kDim), o(q.size()), lse(kQHeads);
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : q) x = normal(rng);
  const uint32_t calls = absl::GetFlag(FLAGS_calls), warmup = absl::GetFlag(FLAGS_warmup);
  std::vector<double> us;
  us.reserve(calls);
  for (uint32_t i = 0; i < warmup + calls; ++i) {
    const auto start = Clock::now();
    if (s = (*kv)->StartAttend(0, q.data(), 1); !s.ok()) return s;
    absl::StatusOr<bool> degraded = (*kv)->FinishAttend(o.data(), lse.data());
    if (!degraded.ok()) return degraded.status();
    if (i >= warmup) {
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    }
  }
  RoundTrip r = Summarize(std::move(us));
  r.degraded = (*kv)->degraded_attends();
  r.shm_attends = (*kv)->shm_attends();
  if (s = (*kv)->Close(); !s.ok()) return s;
  return r;
}

// Percentiles of per-call microseconds.
RoundTrip Summarize(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  RoundTrip r;
  r.median_us = us[us.size() / 2];
  r.p99_us = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  for (double x : us) r.mean_us += x / us.size();
  return r;
}

// The floor under the shm rows: the node's AttendRaw called in this thread, no transport.
absl::StatusOr<RoundTrip> MeasureDirect(gw::NodePool& pool, const std::string& id,
                                        int64_t context) {
  auto kv = gw::RemoteKv::Open(pool, Options(id, gw::NodeTransport::kGrpc, /*beta=*/0.0f));
  if (!kv.ok()) return kv.status();
  const Eviction e(context);
  absl::Status s = (*kv)->Append(0, e.k.data(), e.v.data(), e.maw.data(), context, 1024);
  if (!s.ok()) return s;
  tandem::cpu_attention::CpuAttentionNode& node = pool.embedded()->node();
  constexpr int64_t kG = kQHeads / kKvHeads;
  std::vector<float> q(kQHeads * kDim, 0.5f), o(kQHeads * kDim), lse(kQHeads);
  std::vector<uint32_t> heads(kKvHeads);
  std::vector<uint64_t> selected(kKvHeads), held(kKvHeads);
  tandem::cpu_attention::RawAttendOutput out{o, lse, heads, selected, held};
  static_assert(kKvHeads * kG == kQHeads);
  const uint32_t calls = absl::GetFlag(FLAGS_calls), warmup = absl::GetFlag(FLAGS_warmup);
  std::vector<double> us;
  for (uint32_t i = 0; i < warmup + calls; ++i) {
    const auto start = Clock::now();
    if (s = node.AttendRaw(id, 0, q, 1, &out); !s.ok()) return s;
    if (i >= warmup) {
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    }
  }
  if (s = (*kv)->Close(); !s.ok()) return s;
  return Summarize(std::move(us));
}

// The transport alone: a ShmChannel between two threads carrying an Attend-sized request
// (q of one token) and answer (o, lse and counters of 8 kv heads), copied on both sides.
absl::StatusOr<RoundTrip> MeasureEcho() {
  tandem::cpu_attention::ShmChannelOptions options;
  options.request_capacity = 1 << 20;
  options.response_capacity = 1 << 20;
  options.spin_us = absl::GetFlag(FLAGS_spin_us);
  auto client = tandem::cpu_attention::ShmChannel::Create(options);
  if (!client.ok()) return client.status();
  auto server = tandem::cpu_attention::ShmChannel::Attach(
      (*client)->name(), (*client)->segment_bytes(), (*client)->nonce(), options.spin_us);
  if (!server.ok()) return server.status();
  const size_t request_bytes = 64 + kQHeads * kDim * 4;
  const size_t answer_bytes = 64 + 64 + 2 * 64 + kQHeads * kDim * 4 + kQHeads * 4;
  std::thread thread([&] {
    std::vector<std::byte> q(request_bytes), o(answer_bytes, std::byte{1});
    for (;;) {
      auto request = (*server)->WaitRequest();
      if (!request.ok()) return;
      std::memcpy(q.data(), request->data(), request->size());
      std::memcpy((*server)->response_area().data(), o.data(), o.size());
      (*server)->Reply(o.size());
    }
  });
  std::vector<float> q(kQHeads * kDim, 0.5f), o(q.size());
  const uint32_t calls = absl::GetFlag(FLAGS_calls), warmup = absl::GetFlag(FLAGS_warmup);
  std::vector<double> us;
  absl::Status status;
  for (uint32_t i = 0; i < warmup + calls && status.ok(); ++i) {
    const auto start = Clock::now();
    std::memcpy((*client)->request_area().data() + 64, q.data(), q.size() * 4);
    status = (*client)->Send(request_bytes);
    if (!status.ok()) break;
    auto answer = (*client)->WaitResponse(Clock::now() + std::chrono::seconds(10));
    status = answer.status();
    if (!status.ok()) break;
    std::memcpy(o.data(), answer->data() + 64 + 64 + 128, o.size() * 4);
    if (i >= warmup) {
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    }
  }
  (*server)->Stop();
  thread.join();
  if (!status.ok()) return status;
  return Summarize(std::move(us));
}

struct AppendRate {
  uint64_t bytes = 0;
  double seconds = 0;
  uint64_t shm_chunks = 0;
  std::unique_ptr<gw::RemoteKv> open;   // the session, when the caller keeps it open
};

// Appends `e` round-robin over the layers until `target_bytes`, over RemoteKv or (direct) by
// CpuAttentionNode::AppendKvRaw of the embedded node from this thread (the store's copy alone).
// keep_open: the session (and so its blocks) is handed back in AppendRate::open.
absl::StatusOr<AppendRate> MeasureAppend(gw::NodePool& pool, gw::NodeTransport transport,
                                         bool direct, const std::string& id, uint64_t target_bytes,
                                         const Eviction& e, bool keep_open = false) {
  // β huge: nothing is selected on arrival, so only the store's copy is timed.
  auto kv = gw::RemoteKv::Open(pool, Options(id, transport, /*beta=*/1e30f));
  if (!kv.ok()) return kv.status();
  const std::vector<uint32_t> heads = {0, 1, 2, 3, 4, 5, 6, 7};
  static_assert(kKvHeads == 8);
  const auto* k = reinterpret_cast<const std::byte*>(e.k.data());
  const auto* v = reinterpret_cast<const std::byte*>(e.v.data());
  const auto* maw = reinterpret_cast<const std::byte*>(e.maw.data());
  AppendRate r;
  const auto start = Clock::now();
  for (int64_t layer = 0; r.bytes < target_bytes; layer = (layer + 1) % kLayers) {
    absl::Status s;
    if (direct) {
      tandem::v1::AppendKvResponse totals;
      s = pool.embedded()->node().AppendKvRaw(
          id, static_cast<uint32_t>(layer), heads, {k, e.k.size() * 2}, {v, e.v.size() * 2},
          {maw, e.maw.size() * 4}, static_cast<uint32_t>(e.tokens), 1024, &totals);
    } else {
      s = (*kv)->Append(layer, e.k.data(), e.v.data(), e.maw.data(), e.tokens, 1024);
    }
    if (!s.ok()) return s;
    r.bytes += e.bytes();
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  r.shm_chunks = (*kv)->shm_append_chunks();
  if (keep_open) {
    r.open = std::move(*kv);
    return r;
  }
  if (absl::Status s = (*kv)->Close(); !s.ok()) return s;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "tandem-transport-bench [--cpu_attention_bin=PATH | --cpu_nodes=HOST:PORT] "
      "[--contexts=64,4096] [--calls=2000] [--append_mib=1024]");
  tandem::services::ParseCommandLineOrExitTwo(argc, argv);
  const uint32_t threads = absl::GetFlag(FLAGS_threads);

  gw::NodePoolOptions embedded_options;
  embedded_options.embedded.pool_bytes = absl::GetFlag(FLAGS_pool_mib) << 20;
  embedded_options.embedded.threads = threads;
  embedded_options.embedded.shm_spin_us = absl::GetFlag(FLAGS_spin_us);
  embedded_options.embedded.warm_reserve_bytes = absl::GetFlag(FLAGS_node_warm_reserve).bytes;
  embedded_options.embedded.huge_pages = absl::GetFlag(FLAGS_node_huge_pages);
  auto embedded = gw::NodePool::Create(embedded_options);
  if (!embedded.ok()) {
    std::fprintf(stderr, "embedded node: %s\n", embedded.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<NodeProcess> process;
  std::string address = absl::GetFlag(FLAGS_cpu_nodes);
  if (address.empty() && !absl::GetFlag(FLAGS_cpu_attention_bin).empty()) {
    process = NodeProcess::Start(absl::GetFlag(FLAGS_cpu_attention_bin),
                                 absl::GetFlag(FLAGS_pool_mib), threads);
    if (process == nullptr) {
      std::fprintf(stderr, "could not start %s\n", absl::GetFlag(FLAGS_cpu_attention_bin).c_str());
      return 1;
    }
    address = absl::StrCat("127.0.0.1:", process->port());
  }
  std::unique_ptr<gw::NodePool> remote;
  if (!address.empty()) {
    gw::NodePoolOptions options;
    options.addresses = {address};
    auto pool = gw::NodePool::Create(options);
    if (!pool.ok()) {
      std::fprintf(stderr, "node %s: %s\n", address.c_str(), pool.status().ToString().c_str());
      return 1;
    }
    remote = std::move(*pool);
  }

  struct Row {
    const char* name;
    gw::NodePool* pool;
    gw::NodeTransport transport;
  };
  std::vector<Row> rows = {{"shm-embedded", embedded->get(), gw::NodeTransport::kShm},
                           {"grpc-inproc", embedded->get(), gw::NodeTransport::kGrpc}};
  if (remote != nullptr) {
    rows.push_back({"shm-process", remote.get(), gw::NodeTransport::kShm});
    rows.push_back({"grpc-tcp", remote.get(), gw::NodeTransport::kGrpc});
  }

  std::vector<std::string> table;
  auto report = [&table](const char* name, int64_t context, const RoundTrip& r) {
    nlohmann::json j = {{"bench", "transport_attend"},
                        {"transport", name},
                        {"context", context},
                        {"calls", absl::GetFlag(FLAGS_calls)},
                        {"median_us", r.median_us},
                        {"p99_us", r.p99_us},
                        {"mean_us", r.mean_us},
                        {"degraded", r.degraded},
                        {"shm_attends", r.shm_attends},
                        {"threads", absl::GetFlag(FLAGS_threads)},
                        {"spin_us", absl::GetFlag(FLAGS_spin_us)}};
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
    char line[200];
    std::snprintf(line, sizeof(line), "attend  %-13s ctx %6lld  median %9.1f us  p99 %9.1f us",
                  name, static_cast<long long>(context), r.median_us, r.p99_us);
    table.push_back(line);
  };
  {
    auto echo = MeasureEcho();
    if (!echo.ok()) {
      std::fprintf(stderr, "shm echo: %s\n", echo.status().ToString().c_str());
      return 1;
    }
    report("shm-echo", 0, *echo);
  }
  int session = 0;
  for (const std::string& c : absl::GetFlag(FLAGS_contexts)) {
    int64_t context = 0;
    if (!absl::SimpleAtoi(c, &context) || context < 1) {
      std::fprintf(stderr, "bad --contexts entry '%s'\n", c.c_str());
      return 1;
    }
    for (const Row& row : rows) {
      auto r = MeasureRoundTrip(*row.pool, row.transport, absl::StrCat("rt", session++), context);
      if (!r.ok()) {
        std::fprintf(stderr, "%s context %lld: %s\n", row.name, static_cast<long long>(context),
                     r.status().ToString().c_str());
        return 1;
      }
      report(row.name, context, *r);
    }
    auto direct = MeasureDirect(**embedded, absl::StrCat("rt", session++), context);
    if (!direct.ok()) {
      std::fprintf(stderr, "node-direct: %s\n", direct.status().ToString().c_str());
      return 1;
    }
    report("node-direct", context, *direct);
  }
  const uint64_t append_bytes = absl::GetFlag(FLAGS_append_mib) << 20;
  if (append_bytes > 0) {
    const int64_t tokens = absl::GetFlag(FLAGS_append_tokens);
    if (tokens < 1 || tokens > 65536) {
      std::fprintf(stderr, "--append_tokens %lld is outside 1..65536\n",
                   static_cast<long long>(tokens));
      return 1;
    }
    const Eviction e(tokens);
    auto report_append = [&table](const char* name, const AppendRate& r) {
      const double gbps = r.bytes / r.seconds / 1e9;
      nlohmann::json j = {{"bench", "transport_append"}, {"transport", name},
                          {"bytes", r.bytes},           {"seconds", r.seconds},
                          {"gb_per_s", gbps},           {"shm_chunks", r.shm_chunks},
                          {"append_tokens", absl::GetFlag(FLAGS_append_tokens)}};
      std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);
      char line[200];
      std::snprintf(line, sizeof(line), "append  %-18s %.2f GB in %.2f s  %.2f GB/s", name,
                    r.bytes / 1e9, r.seconds, gbps);
      table.push_back(line);
    };
    // Appends into blocks never written (page faults included), before anything warms the
    // embedded pool; the sessions stay open so each row's blocks are fresh.
    std::vector<std::unique_ptr<gw::RemoteKv>> held;
    if (absl::GetFlag(FLAGS_append_cold)) {
      for (const bool direct : {true, false}) {
        const char* name = direct ? "node-direct-cold" : "shm-embedded-cold";
        auto r = MeasureAppend(**embedded, gw::NodeTransport::kShm, direct,
                               absl::StrCat("cold", session++), append_bytes, e, true);
        if (!r.ok()) {
          std::fprintf(stderr, "%s append: %s\n", name, r.status().ToString().c_str());
          return 1;
        }
        report_append(name, *r);
        held.push_back(std::move(r->open));
      }
    }
    // An untimed append per node first: the node's block memory is then faulted in for every
    // timed row alike (the first session to touch it would pay the page faults otherwise).
    for (gw::NodePool* pool : {embedded->get(), remote.get()}) {
      if (pool == nullptr) continue;
      auto warm = MeasureAppend(*pool, gw::NodeTransport::kGrpc, false,
                                absl::StrCat("warm", session++), append_bytes, e);
      if (!warm.ok()) {
        std::fprintf(stderr, "warm-up append: %s\n", warm.status().ToString().c_str());
        return 1;
      }
    }
    rows.push_back({"node-direct", embedded->get(), gw::NodeTransport::kGrpc});
    for (const Row& row : rows) {
      const bool direct = std::string(row.name) == "node-direct";
      auto r = MeasureAppend(*row.pool, row.transport, direct, absl::StrCat("ap", session++),
                             append_bytes, e);
      if (!r.ok()) {
        std::fprintf(stderr, "%s append: %s\n", row.name, r.status().ToString().c_str());
        return 1;
      }
      report_append(row.name, *r);
    }
    for (auto& kv : held) (void)kv->Close();
  }
  std::printf("\nLlama-3-8B geometry (H_q 32, H_kv 8, D 128, bf16), batch 1, beta 0\n");
  for (const std::string& line : table) std::printf("%s\n", line.c_str());
  return 0;
}
