// tandem-load's gRPC side: channels to the worker, the start-up calls (GetModelInfo, Tokenize of
// a prompt file), and LoadPhase, the client threads that send Generate streams and record what
// each request saw.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "load_stats.h"
#include "load_workload.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::bench {

inline constexpr int64_t kMaxLoadOutputTokens = int64_t{1} << 20;  // the proto's max_tokens cap

// Arguments of channel `index` to the worker: 64 MiB messages, keepalive, and a subchannel pool
// of its own, so that several channels are several connections.
grpc::ChannelArguments LoadChannelArguments(int index);

// The worker's model, waiting up to `timeout_s` for the worker to come up. UNAVAILABLE naming
// `target` when it does not answer.
absl::StatusOr<v1::ModelInfoResponse> FetchModelInfo(v1::Generation::Stub& stub,
                                                     const std::string& target, double timeout_s);

// The tokens of the UTF-8 text file at `path` (at most 64 MiB), tokenized by the worker in 1 MiB
// pieces cut at spaces (no BOS). NOT_FOUND / INVALID_ARGUMENT for the file, the RPC's status
// otherwise.
absl::StatusOr<std::vector<int32_t>> TokenizeFile(v1::Generation::Stub& stub,
                                                  const std::string& path);

// What every request of a run shares.
struct LoadTarget {
  std::string address;                                       // host:port, for messages
  std::vector<std::unique_ptr<v1::Generation::Stub>> stubs;  // thread i uses stubs[i % size]
  v1::GenerateRequest request_template;  // every field but the prompt and max_tokens
  double deadline_s = 600;               // of each Generate call
  double connect_timeout_s = 10;         // of the probe after an UNAVAILABLE request
  int64_t max_context = 0;               // the model's: prompt + output are kept within it
};

struct LoadWorkload {
  const PromptSource* prompts = nullptr;
  const LengthSampler* prompt_lengths = nullptr;
  const LengthSampler* output_lengths = nullptr;
  uint64_t seed = 0;  // request i's lengths and prompt come from RequestSeed(seed, i)
  // Documents prompts start with (none: null or empty): request i sends document
  // i mod their count, then its own prompt_lengths ids. The worker's prefix cache can serve a
  // document after its first request.
  const std::vector<std::vector<int32_t>>* shared_prefixes = nullptr;
};

// One phase of a run (the warmup or the measured requests): `threads` client threads, each with
// one Generate call in flight at a time, take request indices in order until `count` are sent,
// the duration has passed, or Stop(). In an open loop (request_rate > 0) request i is due at the
// i-th Poisson arrival and its thread sleeps until then. Each finished request goes to the
// collector (may be null). A request failing UNAVAILABLE probes the worker (FetchModelInfo,
// connect_timeout_s; one probe at a time): when it does not answer, the phase stops and lost()
// says why.
//
// Thread safety: Start() once; Done(), Stop(), finished(), failed(), elapsed_s() from any
// thread; lost() after Join(). `target`, `workload` and `collector` must outlive the phase.
class LoadPhase {
 public:
  struct Plan {
    int64_t count = 0;
    double duration_s = 0;    // stop sending after this; 0 = no time limit
    double request_rate = 0;  // 0 = closed loop
    int64_t threads = 1;
    uint64_t first_index = 0;  // request indices (seeds, corpus offsets) start here
  };

  LoadPhase(const LoadTarget& target, const LoadWorkload& workload, const Plan& plan,
            LoadCollector* collector);
  ~LoadPhase();  // joins the threads

  void Start();
  bool Done() const { return running_.load() == 0; }
  void Join();
  // No new requests; the ones in flight are cancelled (they end CANCELLED).
  void Stop();

  const absl::Status& lost() const { return lost_; }
  int64_t finished() const { return finished_.load(); }
  int64_t failed() const { return failed_.load(); }
  double elapsed_s() const;

 private:
  using Clock = std::chrono::steady_clock;

  // The call in flight on one thread, for Stop().
  struct Slot {
    std::mutex mu;
    grpc::ClientContext* ctx = nullptr;
  };

  std::optional<std::pair<uint64_t, double>> Take();
  void ClientLoop(size_t thread);
  RequestRecord Send(v1::Generation::Stub& stub, size_t thread, uint64_t index, double due_s);
  void CheckWorker(v1::Generation::Stub& stub, double failed_s);

  const LoadTarget& target_;
  const LoadWorkload workload_;
  const Plan plan_;
  LoadCollector* const collector_;

  std::mutex mu_;  // stopped_, next_, schedule_
  std::condition_variable wake_;
  bool stopped_ = false;
  int64_t next_ = 0;
  ArrivalSchedule schedule_;

  Clock::time_point t0_;
  std::vector<Slot> slots_;
  std::vector<std::thread> threads_;
  std::atomic<int64_t> running_{0}, finished_{0}, failed_{0};

  std::mutex probe_mu_;          // one CheckWorker probe at a time; guards the two below
  double last_probe_ok_s_ = -1;  // the last probe that answered, seconds from t0_
  absl::Status lost_;
};

}  // namespace tandem::bench
