#include "load_client.h"

#include <algorithm>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"

namespace tandem::bench {
namespace {

constexpr size_t kMaxPromptFileBytes = size_t{64} << 20;
constexpr size_t kTokenizeChunkBytes = size_t{1} << 20;
constexpr double kTokenizeDeadlineS = 60;

std::chrono::system_clock::time_point DeadlineIn(double seconds) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(
             std::chrono::duration<double>(seconds));
}

std::string RpcError(const grpc::Status& status) {
  return absl::StrCat(StatusCodeName(status.error_code()), ": ", status.error_message());
}

}  // namespace

grpc::ChannelArguments LoadChannelArguments(int index) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30'000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10'000);
  // Channels to one target share one connection unless each has its own subchannel pool; the
  // index keeps their arguments apart too.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt("tandem.load.channel", index);
  return args;
}

absl::StatusOr<v1::ModelInfoResponse> FetchModelInfo(v1::Generation::Stub& stub,
                                                     const std::string& target, double timeout_s) {
  grpc::ClientContext ctx;
  ctx.set_wait_for_ready(true);
  ctx.set_deadline(DeadlineIn(timeout_s));
  v1::ModelInfoResponse info;
  const grpc::Status status = stub.GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::UnavailableError(
        absl::StrCat("cannot reach the worker at ", target, ": no answer to GetModelInfo within ",
                     timeout_s, " s (--connect_timeout_s); is tandem-gpu-worker running there?"));
  }
  if (!status.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot reach the worker at ", target, ": ", RpcError(status)));
  }
  return info;
}

absl::StatusOr<std::vector<int32_t>> TokenizeFile(v1::Generation::Stub& stub,
                                                  const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open --prompt_source ", path));
  std::string text(kMaxPromptFileBytes + 1, '\0');
  file.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(file.gcount()));
  if (text.size() > kMaxPromptFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is larger than ", kMaxPromptFileBytes >> 20, " MiB"));
  }
  std::vector<int32_t> ids;
  for (absl::string_view piece : SplitText(text, kTokenizeChunkBytes)) {
    v1::TokenizeRequest request;
    request.set_text(std::string(piece));
    v1::TokenizeResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineIn(kTokenizeDeadlineS));
    const grpc::Status status = stub.Tokenize(&ctx, request, &response);
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          absl::StrCat("Tokenize of ", path, ": ", status.error_message()));
    }
    ids.insert(ids.end(), response.token_ids().begin(), response.token_ids().end());
  }
  return ids;
}

LoadPhase::LoadPhase(const LoadTarget& target, const LoadWorkload& workload, const Plan& plan,
                     LoadCollector* collector)
    : target_(target),
      workload_(workload),
      plan_(plan),
      collector_(collector),
      schedule_(plan.request_rate, RequestSeed(workload.seed, ~uint64_t{0})),
      slots_(static_cast<size_t>(plan.threads)) {}

LoadPhase::~LoadPhase() { Join(); }

void LoadPhase::Start() {
  t0_ = Clock::now();
  running_ = plan_.threads;
  for (int64_t i = 0; i < plan_.threads; ++i) {
    threads_.emplace_back([this, i] { ClientLoop(static_cast<size_t>(i)); });
  }
}

void LoadPhase::Join() {
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

void LoadPhase::Stop() {
  {
    std::lock_guard lock(mu_);
    stopped_ = true;
  }
  wake_.notify_all();
  for (Slot& slot : slots_) {
    std::lock_guard lock(slot.mu);
    if (slot.ctx != nullptr) slot.ctx->TryCancel();
  }
}

double LoadPhase::elapsed_s() const {
  return std::chrono::duration<double>(Clock::now() - t0_).count();
}

// The next request's index and due time (seconds from t0_), or nothing when the phase is over.
std::optional<std::pair<uint64_t, double>> LoadPhase::Take() {
  std::lock_guard lock(mu_);
  if (stopped_ || next_ >= plan_.count) return std::nullopt;
  const double now = elapsed_s();
  if (plan_.duration_s > 0 && now >= plan_.duration_s) return std::nullopt;
  double due = now;
  if (plan_.request_rate > 0) {
    due = schedule_.Next();
    if (plan_.duration_s > 0 && due >= plan_.duration_s) return std::nullopt;
  }
  return std::make_pair(plan_.first_index + static_cast<uint64_t>(next_++), due);
}

void LoadPhase::ClientLoop(size_t thread) {
  v1::Generation::Stub& stub = *target_.stubs[thread % target_.stubs.size()];
  while (auto next = Take()) {
    const auto [index, due_s] = *next;
    {
      // Open loop: sleep until due (or Stop()).
      std::unique_lock lock(mu_);
      const auto due =
          t0_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(due_s));
      if (wake_.wait_until(lock, due, [&] { return stopped_; })) break;
    }
    const RequestRecord record = Send(stub, thread, index, due_s);
    if (record.code != 0) failed_.fetch_add(1);
    if (collector_ != nullptr) collector_->Add(record);
    finished_.fetch_add(1);
    if (record.code == grpc::StatusCode::UNAVAILABLE) CheckWorker(stub, record.end_s);
  }
  running_.fetch_sub(1);
}

RequestRecord LoadPhase::Send(v1::Generation::Stub& stub, size_t thread, uint64_t index,
                              double due_s) {
  // Lengths within the context: the output first (max_tokens), the prompt in what is left.
  std::mt19937_64 rng(RequestSeed(workload_.seed, index));
  const int64_t output = workload_.output_lengths->Sample(
      rng, std::min(kMaxLoadOutputTokens, std::max<int64_t>(target_.max_context - 1, 1)));
  const int64_t prompt =
      workload_.prompt_lengths->Sample(rng, std::max<int64_t>(target_.max_context - output, 1));
  v1::GenerateRequest request = target_.request_template;
  const std::vector<int32_t> ids = workload_.prompts->Make(index, prompt, rng);
  auto* prompt_ids = request.mutable_prompt_ids()->mutable_ids();
  if (workload_.shared_prefixes != nullptr && !workload_.shared_prefixes->empty()) {
    const std::vector<int32_t>& prefix =
        (*workload_.shared_prefixes)[index % workload_.shared_prefixes->size()];
    prompt_ids->Assign(prefix.begin(), prefix.end());
  }
  prompt_ids->Add(ids.begin(), ids.end());
  request.set_max_tokens(output);

  RequestRecord record;
  record.scheduled_s = due_s;
  record.prompt_tokens = prompt;
  grpc::ClientContext ctx;
  ctx.set_deadline(DeadlineIn(target_.deadline_s));
  Slot& slot = slots_[thread];
  {
    std::lock_guard lock(slot.mu);
    slot.ctx = &ctx;
  }
  {
    // A Stop() between Take() and registering the context has not seen it.
    std::lock_guard lock(mu_);
    if (stopped_) ctx.TryCancel();
  }
  record.send_s = elapsed_s();
  if (plan_.request_rate <= 0) record.scheduled_s = record.send_s;  // closed loop: no queue
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub.Generate(&ctx, request);
  v1::GenerateResponse message;
  bool got_final = false;
  double last_token_s = -1;
  while (reader->Read(&message)) {
    if (message.has_token()) {
      const double now = elapsed_s();
      if (last_token_s < 0) {
        record.first_token_s = now;
      } else {
        record.itl_s.push_back(now - last_token_s);
      }
      last_token_s = now;
      ++record.output_tokens;
    } else if (message.has_final()) {
      got_final = true;
      record.cached_tokens = message.final().usage().cached_tokens();
      if (message.final().usage().prompt_tokens() > 0) {
        record.prompt_tokens = message.final().usage().prompt_tokens();
      }
    }
  }
  const grpc::Status status = reader->Finish();
  record.end_s = elapsed_s();
  {
    std::lock_guard lock(slot.mu);
    slot.ctx = nullptr;
  }
  if (!status.ok()) {
    record.code = status.error_code();
    record.message = status.error_message();
  } else if (!got_final) {
    record.code = grpc::StatusCode::INTERNAL;
    record.message = "the stream ended OK without a final message";
  }
  return record;
}

// After a request failed UNAVAILABLE at `failed_s`: unless a probe answered since, asks the worker
// for GetModelInfo, waiting up to connect_timeout_s for it to come back; no answer stops the
// phase. The other threads that fail meanwhile wait for this probe and take its answer.
void LoadPhase::CheckWorker(v1::Generation::Stub& stub, double failed_s) {
  std::lock_guard lock(probe_mu_);
  if (!lost_.ok() || last_probe_ok_s_ >= failed_s) return;
  absl::StatusOr<v1::ModelInfoResponse> info =
      FetchModelInfo(stub, target_.address, target_.connect_timeout_s);
  if (info.ok()) {
    last_probe_ok_s_ = elapsed_s();
    return;
  }
  lost_ = absl::UnavailableError(
      absl::StrCat("lost the worker during the run: ", info.status().message()));
  Stop();
}

}  // namespace tandem::bench
