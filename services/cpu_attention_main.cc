// tandem-cpu-attention: serves tandem.v1.CpuAttention (plus health, reflection, channelz) over
// gRPC. The first SIGTERM or SIGINT starts draining (Kubernetes scale-down: new sessions and
// shards are refused, readiness turns NOT_SERVING, the worker migrates or closes the sessions);
// the process stops once no session is left or --drain_timeout_s passed, letting calls in
// flight finish, and exits 0. A second signal stops it at once.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "parse_flags.h"
#include "spdlog/spdlog.h"
#include "stop_signals.h"
#include "tandem/common/byte_size.h"
#include "tandem/cpu_attention/server.h"
#include "tandem/cpu_attention/sparse_attention.h"
#include "tandem/cpu_isa/cpu_isa.h"
#include "tandem/security/authenticator.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50061",
          "host:port to serve on (port 0: any free); 0.0.0.0:50061 serves every interface");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain of this node (with --tls_key: TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA of client certificates: with it every client must present a certificate "
          "signed by it (mutual TLS)");
ABSL_FLAG(std::string, allowed_peers, "",
          "comma-separated certificate identities (SAN or CN) that may call anything but "
          "health, e.g. the GPU worker's; others get PERMISSION_DENIED. Needs --tls_ca; empty = "
          "every client the CA verified");
ABSL_FLAG(unsigned, max_sessions_per_principal, 0,
          "sessions one caller identity may hold; 0 = only --max_sessions bounds them");
ABSL_FLAG(std::string, metrics_address, "",
          "host:port serving Prometheus GET /metrics (e.g. 0.0.0.0:9401; port 0: any free); "
          "\"\" = off");
ABSL_FLAG(unsigned, threads, 0, "attention threads; 0 = every core this process may use");
ABSL_FLAG(unsigned, tasks_per_thread, 2,
          "ranges per attention thread a paged Attend is cut into (1..64)");
ABSL_FLAG(unsigned, dense_tasks_per_thread, 8,
          "ranges per attention thread a dense Attend is cut into (1..64)");
ABSL_FLAG(unsigned, prefetch_entries, 256,
          "entries a paged Attend's scan prefetches ahead of the one it reads (0..4096)");
ABSL_FLAG(unsigned, pool_spin_us, 100,
          "attention threads spin this long after a call before sleeping (0..100000; 0: sleep at "
          "once, for hosts shared with other work)");
ABSL_FLAG(tandem::ByteSize, pool_bytes, tandem::ByteSize{8ull << 30},
          "memory for KV blocks and selected copies, e.g. 64GiB");
ABSL_FLAG(unsigned, block_tokens, 64, "default tokens per KV block (16..256)");
ABSL_FLAG(bool, huge_pages, true,
          "back KV blocks with transparent huge pages: appends into fresh memory fault 2 MiB at "
          "a time (settle appends 2-3x faster on the H200 host; the scan's rate is the same)");
ABSL_FLAG(tandem::ByteSize, warm_reserve, tandem::ByteSize{512ull << 20},
          "free KV block memory kept faulted in while sessions hold blocks, so appends (a "
          "worker's settle) copy at memory speed; 0 = none");
ABSL_FLAG(std::string, node_kv_dtype, "bf16",
          "how KV is stored: bf16 (as the worker sends it) or int8 (8-bit rows with one scale "
          "per token and kv head: about half the memory and scan bytes; quantised on arrival)");
ABSL_FLAG(unsigned, max_sessions, 4096, "sessions the node holds at most");
ABSL_FLAG(unsigned, max_query_tokens, 4096, "query tokens per Attend item / Reselect");
ABSL_FLAG(unsigned, max_batch, 256, "queries per Attend request");
ABSL_FLAG(tandem::ByteSize, max_message_bytes, tandem::ByteSize{64ull << 20},
          "largest gRPC message accepted or sent");
ABSL_FLAG(unsigned, executor_threads, 4, "threads running RPC handlers");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error");
ABSL_FLAG(double, release_free_after_s, 30,
          "return the pages of KV blocks left free this long to the kernel, so the node's "
          "resident memory falls after sessions end; negative = keep them");
ABSL_FLAG(unsigned, drain_timeout_s, 30,
          "after the first SIGTERM/SIGINT, wait at most this long for the sessions to be closed "
          "or migrated away before stopping; 0 = stop at once");

namespace {

// Waits for a stop signal for up to `timeout` (forever when negative). Returns the signal, or
// 0 when the time ran out.
int WaitSignal(const sigset_t& signals, std::chrono::milliseconds timeout) {
  for (;;) {
    int sig = 0;
    if (timeout.count() < 0) {
      if (sigwait(&signals, &sig) == 0) return sig;
      continue;
    }
    timespec ts{static_cast<time_t>(timeout.count() / 1000),
                static_cast<long>(timeout.count() % 1000) * 1'000'000};
    sig = sigtimedwait(&signals, nullptr, &ts);
    if (sig > 0) return sig;
    if (errno == EAGAIN) return 0;  // timed out; EINTR: try again
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Before anything starts a thread (stop_signals.h); the main thread waits for them below.
  const sigset_t stop_signals = tandem::services::BlockStopSignals();
  absl::SetProgramUsageMessage(
      "tandem CPU attention node: holds offloaded KV and answers attention queries.\n"
      "  tandem-cpu-attention --address=0.0.0.0:50061 --pool_bytes=64GiB --threads=16");
  const std::vector<char*> positional = tandem::services::ParseCommandLineOrExitTwo(argc, argv);
  if (positional.size() > 1) {
    std::fprintf(stderr, "tandem-cpu-attention: unexpected argument '%s'\n", positional[1]);
    return 2;
  }
  spdlog::set_level(spdlog::level::from_str(absl::GetFlag(FLAGS_log_level)));
  if (const absl::Status isa = tandem::CheckCpuIsaEnvironment(); !isa.ok()) {
    std::fprintf(stderr, "tandem-cpu-attention: %s\n", std::string(isa.message()).c_str());
    return 2;
  }
  spdlog::info("{}; bf16 KV attention: {}", tandem::CpuIsaSummary(),
               tandem::cpu_attention::Bf16AttentionPath());

  tandem::cpu_attention::ServerOptions options;
  options.address = absl::GetFlag(FLAGS_address);
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  options.node.threads = absl::GetFlag(FLAGS_threads);
  options.node.tasks_per_thread = absl::GetFlag(FLAGS_tasks_per_thread);
  options.node.dense_tasks_per_thread = absl::GetFlag(FLAGS_dense_tasks_per_thread);
  options.node.prefetch_entries = absl::GetFlag(FLAGS_prefetch_entries);
  options.node.pool_spin_us = absl::GetFlag(FLAGS_pool_spin_us);
  options.node.pool_bytes = absl::GetFlag(FLAGS_pool_bytes).bytes;
  options.node.block_tokens = absl::GetFlag(FLAGS_block_tokens);
  options.node.huge_pages = absl::GetFlag(FLAGS_huge_pages);
  options.node.warm_reserve_bytes = absl::GetFlag(FLAGS_warm_reserve).bytes;
  absl::StatusOr<tandem::kv_store::KvDType> kv_dtype =
      tandem::cpu_attention::ParseNodeKvDType(absl::GetFlag(FLAGS_node_kv_dtype));
  if (!kv_dtype.ok()) {
    std::fprintf(stderr, "tandem-cpu-attention: --%s\n",
                 std::string(kv_dtype.status().message()).c_str());
    return 2;
  }
  options.node.kv_dtype = *kv_dtype;
  options.node.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  options.node.max_sessions_per_principal = absl::GetFlag(FLAGS_max_sessions_per_principal);
  options.tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                 absl::GetFlag(FLAGS_tls_ca)};
  options.allowed_peers = tandem::security::ParsePeerList(absl::GetFlag(FLAGS_allowed_peers));
  options.node.max_query_tokens = absl::GetFlag(FLAGS_max_query_tokens);
  options.node.max_batch = absl::GetFlag(FLAGS_max_batch);
  options.executor_threads = absl::GetFlag(FLAGS_executor_threads);
  const double release_after_s = absl::GetFlag(FLAGS_release_free_after_s);
  if (std::isnan(release_after_s) || release_after_s > 86400) {
    std::fprintf(stderr,
                 "tandem-cpu-attention: --release_free_after_s must be a number of seconds up "
                 "to 86400 (negative: never), got %g\n",
                 release_after_s);
    return 2;
  }
  options.node.release_free_after = std::chrono::milliseconds(
      release_after_s < 0 ? -1 : static_cast<int64_t>(release_after_s * 1000));
  const uint64_t max_message = absl::GetFlag(FLAGS_max_message_bytes).bytes;
  if (max_message > (1u << 30)) {
    std::fprintf(stderr, "tandem-cpu-attention: --max_message_bytes %s exceeds 1 GiB\n",
                 tandem::FormatBytes(max_message).c_str());
    return 2;
  }
  options.max_message_bytes = static_cast<int>(max_message);

  auto server = tandem::cpu_attention::CpuAttentionServer::Start(options);
  if (!server.ok()) {
    spdlog::error("cannot start: {}", server.status().ToString());
    return 1;
  }
  const auto stats = (*server)->node().Stats();
  spdlog::info("tandem-cpu-attention serving on port {} ({} threads, pool {}, {})",
               (*server)->port(), stats.threads(), tandem::FormatBytes(stats.capacity_bytes()),
               options.tls.ca.empty()
                   ? (options.tls.enabled() ? "TLS" : "plaintext, no authentication")
                   : (options.allowed_peers.empty() ? "mutual TLS, any certificate of the CA"
                                                    : "mutual TLS, --allowed_peers only"));
  if ((*server)->metrics_port() != 0) {
    spdlog::info("Prometheus metrics on port {} (GET /metrics)", (*server)->metrics_port());
  }
  // A line scripts can wait for.
  std::printf("LISTENING %d\n", (*server)->port());
  std::fflush(stdout);

  tandem::cpu_attention::CpuAttentionServer& s = **server;
  int sig = WaitSignal(stop_signals, std::chrono::milliseconds(-1));
  int grace_ms = 2000;  // calls in flight may finish
  const unsigned drain_timeout_s = absl::GetFlag(FLAGS_drain_timeout_s);
  if (drain_timeout_s == 0) {
    spdlog::info("signal {}: stopping (--drain_timeout_s=0)", sig);
  } else {
    s.StartDraining();
    spdlog::info(
        "signal {}: draining: new sessions refused, readiness NOT_SERVING; waiting up to "
        "{} s for {} session(s) to close (a second signal stops at once)",
        sig, drain_timeout_s, s.node().Stats().sessions());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(drain_timeout_s);
    for (;;) {
      const uint32_t sessions = s.node().Stats().sessions();
      if (sessions == 0) {
        spdlog::info("drained: no session left");
        break;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        spdlog::warn("drain timeout ({} s): stopping with {} session(s) open", drain_timeout_s,
                     sessions);
        break;
      }
      sig = WaitSignal(stop_signals, std::min(left, std::chrono::milliseconds(100)));
      if (sig != 0) {
        spdlog::warn("signal {} while draining: stopping at once with {} session(s) open", sig,
                     sessions);
        grace_ms = 0;
        break;
      }
    }
  }
  s.Shutdown(grace_ms);
  s.Wait();
  spdlog::info("stopped");
  return 0;
}
