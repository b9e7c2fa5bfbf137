// A CPU attention server on a free loopback port for the exact-mode failover tests: 32 MiB pool,
// one attention thread, 16-token blocks (small enough that many start in one test binary).
#pragma once

#include <memory>

#include <gtest/gtest.h>

#include "tandem/cpu_attention/server.h"

namespace tandem::gpu_worker::testing {

// Null (and a test failure) when the server does not start.
inline std::unique_ptr<cpu_attention::CpuAttentionServer> StartLoopbackNode() {
  cpu_attention::ServerOptions o;
  o.address = "127.0.0.1:0";
  o.node.pool_bytes = 32ull << 20;
  o.node.threads = 1;
  o.node.block_tokens = 16;
  auto server = cpu_attention::CpuAttentionServer::Start(o);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

}  // namespace tandem::gpu_worker::testing
