// The GPU workers behind the gateway: one gRPC channel each (tandem.v1.Generation), their health
// (grpc.health.v1 Check of "tandem.v1.Generation", polled by a background thread, and failed
// calls), their model info, and the routing of requests:
// - a request with a session_id goes to the worker that already holds that session (a sticky
//   map, least recently used entries forgotten past `max_sticky_sessions`); a new session goes
//   where a one-shot request would;
// - a one-shot request with a prefix key (its prompt's leading bytes and cache scope, see
//   PrefixKey) goes to the worker that served the last request with that key, whose prefix
//   cache may hold that start, unless that worker is not serving or has more than
//   kAffinitySlack more requests outstanding than the least loaded one;
// - otherwise the serving worker with the fewest outstanding requests (ties: round-robin).
//
// Thread-safe. Leases must not outlive the pool.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::gateway {

struct WorkerPoolOptions {
  std::vector<std::string> addresses;    // host:port of each tandem-gpu-worker
  int health_interval_ms = 2000;         // between health rounds
  int rpc_timeout_ms = 10000;            // deadline of unary calls (health, info, tokenize)
  int max_message_bytes = 64 << 20;      // as the workers' --max_message_bytes
  size_t max_sticky_sessions = 1 << 16;  // session -> worker entries remembered
  // Credentials of the channels to the workers (tandem/security/credentials.h: TLS, a client
  // certificate, a bearer token); null = plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // Name the workers' certificate is checked against instead of each address's host; "" = it.
  std::string tls_server_name;
};

struct WorkerState {
  std::string address;
  bool serving = false;
  int64_t outstanding = 0;  // requests routed to it and not finished
};

class WorkerPool {
 private:
  struct Worker;

 public:
  // One request's hold on a worker: counted as outstanding until destroyed. Movable.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease();

    v1::Generation::Stub& stub() const;
    const std::string& address() const;
    size_t index() const { return index_; }
    // The request continues a session an earlier request was routed to (its worker holds it,
    // unless that request failed before the session began: see ForgetSession).
    bool continued_session() const { return continued_session_; }
    // A call through this lease failed with UNAVAILABLE: the worker takes no new requests until
    // a health check finds it SERVING again.
    void MarkUnavailable() const;

   private:
    friend class WorkerPool;
    Lease(Worker* worker, size_t index, bool continued)
        : worker_(worker), index_(index), continued_session_(continued) {}
    Worker* worker_ = nullptr;
    size_t index_ = 0;
    bool continued_session_ = false;
  };

  // INVALID_ARGUMENT without addresses. Runs one health round before returning (workers that
  // are down are fine: they join when they answer), then keeps polling in the background.
  static absl::StatusOr<std::unique_ptr<WorkerPool>> Create(const WorkerPoolOptions& options);
  ~WorkerPool();  // stops the health thread

  // The worker for a request (see the header). UNAVAILABLE when no worker is serving, or when
  // the worker holding `session_id` is not.
  absl::StatusOr<Lease> Acquire(const std::string& session_id, const std::string& prefix_key = "");

  // Outstanding requests a worker may have beyond the least loaded one and still get the
  // requests whose prompts start as its last ones did.
  static constexpr int64_t kAffinitySlack = 4;
  // Bytes of a prompt's start that name its prefix key.
  static constexpr size_t kPrefixKeyBytes = 4096;
  // The routing key of a one-shot prompt: its scope (the cache salt the worker will see) and its
  // first kPrefixKeyBytes bytes; empty for a prompt shorter than that (nothing worth routing).
  static std::string PrefixKey(const std::string& scope, const std::string& prompt);

  // Closes a kept session (Generation.CloseSession) on the worker holding it: the remembered
  // one (UNAVAILABLE when it is not serving), else every serving worker in turn (the entry may
  // have been forgotten). NOT_FOUND when no worker holds it; other errors pass through.
  absl::Status CloseSession(const std::string& session_id);

  // Forgets where `session_id` lives: its first request failed before the worker created it (a
  // failed request changes nothing there), so the next one starts it anew.
  void ForgetSession(const std::string& session_id);

  // The model info of the first serving worker that has answered GetModelInfo; UNAVAILABLE
  // when none has.
  absl::StatusOr<v1::ModelInfoResponse> ModelInfo() const;

  // Runs a health round now (tests; the background thread does it every health_interval_ms).
  void CheckHealthNow();

  std::vector<WorkerState> States() const;
  size_t ServingCount() const;
  size_t size() const { return workers_.size(); }
  const WorkerPoolOptions& options() const { return options_; }

 private:
  struct Worker {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::Generation::Stub> stub;
    std::atomic<bool> serving{false};
    std::atomic<int64_t> outstanding{0};
    std::optional<v1::ModelInfoResponse> info;  // guarded by WorkerPool::info_mu_
  };

  explicit WorkerPool(const WorkerPoolOptions& options);
  void HealthLoop();
  void CheckOne(Worker& worker);
  // Least outstanding among serving workers (ties: round-robin); nullopt when none serves.
  std::optional<size_t> LeastLoaded();
  void Remember(const std::string& session_id, size_t index);  // needs sticky_mu_

  WorkerPoolOptions options_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<size_t> next_start_{0};  // where the next least-loaded scan starts

  mutable std::mutex info_mu_;

  std::mutex sticky_mu_;
  std::list<std::string> sticky_lru_;  // most recently used first
  struct StickyEntry {
    size_t worker;
    std::list<std::string>::iterator lru;
  };
  std::unordered_map<std::string, StickyEntry> sticky_;

  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;  // guarded by stop_mu_
  std::thread health_thread_;
};

// Channel arguments for a worker: message limits as the worker's, keepalive pings.
grpc::ChannelArguments WorkerChannelArguments(int max_message_bytes);

}  // namespace tandem::gateway
