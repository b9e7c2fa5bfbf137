#include "shm_session_server.h"

#include "tandem/cpu_attention/cpu_attention_node.h"

namespace tandem::cpu_attention {

absl::StatusOr<std::unique_ptr<ShmSessionServer>> ShmSessionServer::Start(
    CpuAttentionNode* node, std::string session_id, ShmSessionGeometry geometry,
    const std::string& name, uint64_t segment_bytes, uint64_t nonce, uint32_t spin_us,
    std::atomic<uint64_t>* requests_served) {
  absl::StatusOr<std::unique_ptr<ShmChannel>> channel =
      ShmChannel::Attach(name, segment_bytes, nonce, spin_us);
  if (!channel.ok()) return channel.status();
  std::unique_ptr<ShmSessionServer> server(new ShmSessionServer());
  server->node_ = node;
  server->session_id_ = std::move(session_id);
  server->geometry_ = std::move(geometry);
  server->channel_ = std::move(*channel);
  server->requests_served_ = requests_served;
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  return server;
}

ShmSessionServer::~ShmSessionServer() {
  if (channel_ != nullptr) channel_->Stop();
  if (thread_.joinable()) thread_.join();
}

void ShmSessionServer::Loop() {
  for (;;) {
    absl::StatusOr<std::span<const std::byte>> request = channel_->WaitRequest();
    if (absl::IsCancelled(request.status())) return;
    const std::span<std::byte> area = channel_->response_area();
    const uint64_t bytes = request.ok()
                               ? ServeShmRequest(*node_, session_id_, geometry_, *request, area)
                               : ShmErrorReply(request.status(), area);
    // Counted before the answer is released, so a client that has its answer sees it counted.
    requests_served_->fetch_add(1, std::memory_order_relaxed);
    channel_->Reply(bytes);
  }
}

}  // namespace tandem::cpu_attention
