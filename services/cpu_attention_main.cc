// tandem-cpu-attention: serves tandem.v1.CpuAttention (plus health, reflection, channelz) over
// gRPC until SIGINT or SIGTERM, then drains calls in flight and exits.
#include <csignal>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "spdlog/spdlog.h"
#include "tandem/common/byte_size.h"
#include "tandem/cpu_attention/server.h"

ABSL_FLAG(std::string, address, "0.0.0.0:50061", "host:port to serve on (port 0: any free)");
ABSL_FLAG(unsigned, threads, 0, "attention threads; 0 = every core this process may use");
ABSL_FLAG(tandem::ByteSize, pool_bytes, tandem::ByteSize{8ull << 30},
          "memory for KV blocks and selected copies, e.g. 64GiB");
ABSL_FLAG(unsigned, block_tokens, 64, "default tokens per KV block (16..256)");
ABSL_FLAG(unsigned, max_sessions, 4096, "sessions the node holds at most");
ABSL_FLAG(unsigned, max_query_tokens, 4096, "query tokens per Attend item / Reselect");
ABSL_FLAG(unsigned, max_batch, 256, "queries per Attend request");
ABSL_FLAG(tandem::ByteSize, max_message_bytes, tandem::ByteSize{64ull << 20},
          "largest gRPC message accepted or sent");
ABSL_FLAG(unsigned, executor_threads, 4, "threads running RPC handlers");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "tandem CPU attention node: holds offloaded KV and answers attention queries.\n"
      "  tandem-cpu-attention --address=0.0.0.0:50061 --pool_bytes=64GiB --threads=16");
  absl::ParseCommandLine(argc, argv);
  spdlog::set_level(spdlog::level::from_str(absl::GetFlag(FLAGS_log_level)));

  // Block the stop signals in every thread; the main thread waits for them below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  tandem::cpu_attention::ServerOptions options;
  options.address = absl::GetFlag(FLAGS_address);
  options.node.threads = absl::GetFlag(FLAGS_threads);
  options.node.pool_bytes = absl::GetFlag(FLAGS_pool_bytes).bytes;
  options.node.block_tokens = absl::GetFlag(FLAGS_block_tokens);
  options.node.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  options.node.max_query_tokens = absl::GetFlag(FLAGS_max_query_tokens);
  options.node.max_batch = absl::GetFlag(FLAGS_max_batch);
  options.executor_threads = absl::GetFlag(FLAGS_executor_threads);
  const uint64_t max_message = absl::GetFlag(FLAGS_max_message_bytes).bytes;
  if (max_message > (1u << 30)) {
    spdlog::error("--max_message_bytes {} exceeds 1 GiB", max_message);
    return 2;
  }
  options.max_message_bytes = static_cast<int>(max_message);

  auto server = tandem::cpu_attention::CpuAttentionServer::Start(options);
  if (!server.ok()) {
    spdlog::error("cannot start: {}", server.status().ToString());
    return 1;
  }
  const auto stats = (*server)->node().Stats();
  spdlog::info("tandem-cpu-attention serving on port {} ({} threads, pool {:.2f} GiB)",
               (*server)->port(), stats.threads(), stats.capacity_bytes() / double(1ull << 30));
  // A line scripts can wait for.
  std::printf("LISTENING %d\n", (*server)->port());
  std::fflush(stdout);

  int sig = 0;
  sigwait(&stop_signals, &sig);
  spdlog::info("signal {}: draining", sig);
  (*server)->Shutdown();
  (*server)->Wait();
  spdlog::info("stopped");
  return 0;
}
