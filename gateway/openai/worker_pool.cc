#include "tandem/gateway/worker_pool.h"

#include <grpcpp/generic/generic_stub.h>

#include <chrono>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "tandem/common/grpc_status.h"
#include "tandem/security/credentials.h"

namespace tandem::gateway {
namespace {

constexpr char kHealthMethod[] = "/grpc.health.v1.Health/Check";
constexpr char kServiceName[] = "tandem.v1.Generation";

std::chrono::system_clock::time_point DeadlineIn(int ms) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(ms);
}

// grpc.health.v1 Check through a generic stub (the health proto's client is not built here):
// true iff the answer is SERVING (HealthCheckResponse {status: 1} = bytes 08 01).
bool HealthCheck(const std::shared_ptr<grpc::Channel>& channel, int timeout_ms) {
  grpc::GenericStub generic(channel);
  std::string request;
  request.push_back(0x0a);  // field 1 (service), length-delimited
  request.push_back(static_cast<char>(sizeof(kServiceName) - 1));
  request += kServiceName;
  grpc::Slice slice(request);
  grpc::ByteBuffer send(&slice, 1), recv;
  grpc::ClientContext ctx;
  ctx.set_deadline(DeadlineIn(timeout_ms));
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  generic.UnaryCall(&ctx, kHealthMethod, grpc::StubOptions(), &send, &recv, [&](grpc::Status s) {
    std::lock_guard lock(mu);
    status = std::move(s);
    done = true;
    cv.notify_one();
  });
  std::unique_lock lock(mu);
  cv.wait(lock, [&] { return done; });
  if (!status.ok()) return false;
  std::vector<grpc::Slice> slices;
  if (!recv.Dump(&slices).ok()) return false;
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes == std::string("\x08\x01", 2);
}

}  // namespace

grpc::ChannelArguments WorkerChannelArguments(int max_message_bytes) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_message_bytes);
  args.SetMaxSendMessageSize(max_message_bytes);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
  // Reconnect quickly after a worker restarts (gRPC's default backoff grows to 120 s).
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  return args;
}

WorkerPool::Lease::Lease(Lease&& other) noexcept
    : worker_(std::exchange(other.worker_, nullptr)),
      index_(other.index_),
      continued_session_(other.continued_session_) {}

WorkerPool::Lease& WorkerPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    if (worker_ != nullptr) worker_->outstanding.fetch_sub(1);
    worker_ = std::exchange(other.worker_, nullptr);
    index_ = other.index_;
    continued_session_ = other.continued_session_;
  }
  return *this;
}

WorkerPool::Lease::~Lease() {
  if (worker_ != nullptr) worker_->outstanding.fetch_sub(1);
}

v1::Generation::Stub& WorkerPool::Lease::stub() const { return *worker_->stub; }
const std::string& WorkerPool::Lease::address() const { return worker_->address; }

void WorkerPool::Lease::MarkUnavailable() const {
  if (worker_ != nullptr && worker_->serving.exchange(false)) {
    spdlog::warn("worker {} failed a call with UNAVAILABLE: not routed to until healthy",
                 worker_->address);
  }
}

WorkerPool::WorkerPool(const WorkerPoolOptions& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<WorkerPool>> WorkerPool::Create(const WorkerPoolOptions& options) {
  if (options.addresses.empty()) {
    return absl::InvalidArgumentError("at least one worker address is needed (--workers)");
  }
  if (options.health_interval_ms < 1 || options.rpc_timeout_ms < 1) {
    return absl::InvalidArgumentError("health interval and RPC timeout must be >= 1 ms");
  }
  std::unique_ptr<WorkerPool> pool(new WorkerPool(options));
  for (const std::string& address : options.addresses) {
    auto w = std::make_unique<Worker>();
    w->address = address;
    grpc::ChannelArguments args = WorkerChannelArguments(options.max_message_bytes);
    security::SetTlsServerName(options.tls_server_name, &args);
    w->channel = grpc::CreateCustomChannel(
        address,
        options.credentials != nullptr ? options.credentials : grpc::InsecureChannelCredentials(),
        args);
    w->stub = v1::Generation::NewStub(w->channel);
    pool->workers_.push_back(std::move(w));
  }
  pool->CheckHealthNow();
  pool->health_thread_ = std::thread([p = pool.get()] { p->HealthLoop(); });
  return pool;
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard lock(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (health_thread_.joinable()) health_thread_.join();
}

void WorkerPool::HealthLoop() {
  std::unique_lock lock(stop_mu_);
  while (!stop_cv_.wait_for(lock, std::chrono::milliseconds(options_.health_interval_ms),
                            [this] { return stop_; })) {
    lock.unlock();
    CheckHealthNow();
    lock.lock();
  }
}

void WorkerPool::CheckHealthNow() {
  for (auto& w : workers_) CheckOne(*w);
}

void WorkerPool::CheckOne(Worker& w) {
  const bool serving = HealthCheck(w.channel, options_.rpc_timeout_ms);
  bool need_info;
  {
    std::lock_guard lock(info_mu_);
    need_info = serving && !w.info.has_value();
  }
  if (need_info) {
    v1::ModelInfoResponse info;
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineIn(options_.rpc_timeout_ms));
    const grpc::Status s = w.stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
    if (s.ok()) {
      std::lock_guard lock(info_mu_);
      w.info = std::move(info);
    } else {
      spdlog::warn("worker {}: GetModelInfo failed: {}", w.address, s.error_message());
    }
  }
  const bool was = w.serving.exchange(serving);
  if (was != serving) {
    spdlog::info("worker {} is {}", w.address, serving ? "SERVING" : "not serving");
  }
}

absl::StatusOr<v1::ModelInfoResponse> WorkerPool::ModelInfo() const {
  std::lock_guard lock(info_mu_);
  for (const auto& w : workers_) {
    if (w->info.has_value() && w->serving.load()) return *w->info;
  }
  for (const auto& w : workers_) {
    if (w->info.has_value()) return *w->info;  // known model, its worker down right now
  }
  return absl::UnavailableError("no GPU worker has answered yet (is --workers right?)");
}

std::optional<size_t> WorkerPool::LeastLoaded() {
  std::optional<size_t> best;
  int64_t best_load = std::numeric_limits<int64_t>::max();
  // Ties go round-robin: the scan starts one worker further each time.
  const size_t start = next_start_.fetch_add(1);
  for (size_t k = 0; k < workers_.size(); ++k) {
    const size_t i = (start + k) % workers_.size();
    if (!workers_[i]->serving.load()) continue;
    const int64_t load = workers_[i]->outstanding.load();
    if (load < best_load) {
      best = i;
      best_load = load;
    }
  }
  return best;
}

void WorkerPool::Remember(const std::string& session_id, size_t index) {
  sticky_lru_.push_front(session_id);
  sticky_[session_id] = StickyEntry{index, sticky_lru_.begin()};
  while (sticky_.size() > options_.max_sticky_sessions) {
    sticky_.erase(sticky_lru_.back());
    sticky_lru_.pop_back();
  }
}

std::string WorkerPool::PrefixKey(const std::string& scope, const std::string& prompt) {
  if (prompt.size() < kPrefixKeyBytes) return "";
  // The sticky map's keys share one space with session ids, which never contain '\n'.
  return absl::StrCat("\nprefix ", scope.size(), ":", scope, "\n",
                      absl::string_view(prompt).substr(0, kPrefixKeyBytes));
}

absl::StatusOr<WorkerPool::Lease> WorkerPool::Acquire(const std::string& session_id,
                                                      const std::string& prefix_key) {
  size_t index;
  bool continued = false;
  if (session_id.empty()) {
    const std::optional<size_t> best = LeastLoaded();
    if (!best.has_value()) return absl::UnavailableError("no GPU worker is serving");
    index = *best;
    if (!prefix_key.empty()) {
      std::lock_guard lock(sticky_mu_);
      auto it = sticky_.find(prefix_key);
      if (it != sticky_.end()) {
        const Worker& last = *workers_[it->second.worker];
        if (last.serving.load() && last.outstanding.load() <=
                                       workers_[index]->outstanding.load() + kAffinitySlack) {
          index = it->second.worker;
        }
        sticky_lru_.erase(it->second.lru);
        sticky_.erase(it);
      }
      Remember(prefix_key, index);
    }
  } else {
    std::lock_guard lock(sticky_mu_);
    auto it = sticky_.find(session_id);
    if (it != sticky_.end()) {
      index = it->second.worker;
      if (!workers_[index]->serving.load()) {
        return absl::UnavailableError(absl::StrCat("the GPU worker holding session '", session_id,
                                                   "' (", workers_[index]->address,
                                                   ") is not serving"));
      }
      sticky_lru_.splice(sticky_lru_.begin(), sticky_lru_, it->second.lru);
      continued = true;
    } else {
      const std::optional<size_t> best = LeastLoaded();
      if (!best.has_value()) return absl::UnavailableError("no GPU worker is serving");
      index = *best;
      Remember(session_id, index);
    }
  }
  Worker* w = workers_[index].get();
  w->outstanding.fetch_add(1);
  return Lease(w, index, continued);
}

absl::Status WorkerPool::CloseSession(const std::string& session_id) {
  std::optional<size_t> known;
  {
    std::lock_guard lock(sticky_mu_);
    auto it = sticky_.find(session_id);
    if (it != sticky_.end()) known = it->second.worker;
  }
  if (known.has_value() && !workers_[*known]->serving.load()) {
    return absl::UnavailableError(absl::StrCat("the GPU worker holding session '", session_id,
                                               "' (", workers_[*known]->address,
                                               ") is not serving"));
  }
  std::vector<size_t> order;
  if (known.has_value()) order.push_back(*known);
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (i != known && workers_[i]->serving.load()) order.push_back(i);
  }
  for (size_t i : order) {
    v1::CloseGenerationSessionRequest request;
    request.set_session_id(session_id);
    v1::CloseGenerationSessionResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineIn(options_.rpc_timeout_ms));
    const absl::Status s =
        FromGrpcStatus(workers_[i]->stub->CloseSession(&ctx, request, &response));
    if (s.code() == absl::StatusCode::kNotFound) continue;  // not there: ask the next one
    if (s.ok()) ForgetSession(session_id);
    return s;
  }
  ForgetSession(session_id);
  return absl::NotFoundError(absl::StrCat("no GPU worker holds session '", session_id, "'"));
}

void WorkerPool::ForgetSession(const std::string& session_id) {
  std::lock_guard lock(sticky_mu_);
  auto it = sticky_.find(session_id);
  if (it == sticky_.end()) return;
  sticky_lru_.erase(it->second.lru);
  sticky_.erase(it);
}

std::vector<WorkerState> WorkerPool::States() const {
  std::vector<WorkerState> states;
  for (const auto& w : workers_) {
    states.push_back({w->address, w->serving.load(), w->outstanding.load()});
  }
  return states;
}

size_t WorkerPool::ServingCount() const {
  size_t n = 0;
  for (const auto& w : workers_) n += w->serving.load() ? 1 : 0;
  return n;
}

}  // namespace tandem::gateway
