// ShmSessionServer: serves one session's shared-memory channel (shm_channel.h, messages in
// shm_protocol.h) on a thread of its own: waits for a request (spinning briefly, then sleeping in
// a futex), runs it through ServeShmRequest (shm_request_handler.h), which writes the answer
// into the response area. Attend output is computed straight into the response area.
//
// Owned by the CpuAttentionNode; destroying it stops and joins the thread and unmaps the
// segment. The node must outlive it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "shm_request_handler.h"
#include "tandem/cpu_attention/shm_channel.h"

namespace tandem::cpu_attention {

class CpuAttentionNode;

class ShmSessionServer {
 public:
  // Maps the channel (see ShmChannel::Attach for the errors) and starts the thread.
  static absl::StatusOr<std::unique_ptr<ShmSessionServer>> Start(
      CpuAttentionNode* node, std::string session_id, ShmSessionGeometry geometry,
      const std::string& name, uint64_t segment_bytes, uint64_t nonce, uint32_t spin_us,
      std::atomic<uint64_t>* requests_served);
  ~ShmSessionServer();

 private:
  ShmSessionServer() = default;
  void Loop();

  CpuAttentionNode* node_ = nullptr;
  std::string session_id_;
  ShmSessionGeometry geometry_;
  std::unique_ptr<ShmChannel> channel_;
  std::atomic<uint64_t>* requests_served_ = nullptr;
  std::thread thread_;
};

}  // namespace tandem::cpu_attention
