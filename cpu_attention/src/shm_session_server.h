// ShmSessionServer: serves one session's shared-memory channel (shm_channel.h, messages in
// shm_protocol.h) on a thread of its own: waits for a request (spinning briefly, then sleeping in
// a futex), runs it through CpuAttentionNode::AttendRaw / AppendKvRaw, and writes the answer
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
#include "tandem/cpu_attention/shm_channel.h"

namespace tandem::cpu_attention {

class CpuAttentionNode;
struct ShmRequestView;

// What the channel thread needs to know about the session to lay out messages. The owned kv
// heads are not here: ReshardSession changes them, so an Attend answer is laid out for the
// heads the node finds under the session's lock (CpuAttentionNode::AttendRaw's output_for).
struct ShmSessionGeometry {
  uint32_t num_q_heads = 0;
  uint32_t head_dim = 0;
  uint32_t group = 0;                 // G = H_q / H_kv
  uint32_t kv_row_bytes = 0;          // D * bytes of the kv dtype
};

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
  // Handles one request; returns the bytes of the response written.
  uint64_t Serve(std::span<const std::byte> request);
  uint64_t ServeAttend(const ShmRequestView& request);
  uint64_t ServeAppend(const ShmRequestView& request);
  uint64_t Error(const absl::Status& status);

  CpuAttentionNode* node_ = nullptr;
  std::string session_id_;
  ShmSessionGeometry geometry_;
  std::unique_ptr<ShmChannel> channel_;
  std::atomic<uint64_t>* requests_served_ = nullptr;
  std::thread thread_;
};

}  // namespace tandem::cpu_attention
