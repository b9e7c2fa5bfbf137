#include "prompt_encoder.h"

#include <malloc.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace tandem::gpu_worker {
namespace {

// Texts at least this large give their freed heap back after tokenizing (the pre-tokenizer's
// pieces and the ids take several times the text).
constexpr size_t kTrimAfterBytes = 1 << 20;

}  // namespace

PromptEncoder::PromptEncoder(const Tokenizer& tokenizer, int64_t max_context, int threads,
                             size_t max_queued)
    : tokenizer_(tokenizer),
      max_context_(max_context),
      max_token_bytes_(MaxTokenBytes(tokenizer)),
      max_queued_(max_queued) {
  for (int i = 0; i < std::max(threads, 1); ++i) threads_.emplace_back([this] { Loop(); });
}

PromptEncoder::~PromptEncoder() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  ready_.notify_all();
  for (std::thread& t : threads_) t.join();
}

absl::Status PromptEncoder::CheckFits(const std::string& text) const {
  return CheckPromptTextFits(text, max_context_, max_token_bytes_);
}

absl::Status PromptEncoder::Encode(std::string text, Done done) {
  {
    std::lock_guard lock(mu_);
    if (stop_) return absl::UnavailableError("the worker is shutting down");
    if (queue_.size() >= max_queued_) {
      return absl::ResourceExhaustedError(
          absl::StrCat(queue_.size(), " prompts are waiting to be tokenized; retry later"));
    }
    queue_.push_back(Job{std::move(text), std::move(done)});
  }
  ready_.notify_one();
  return absl::OkStatus();
}

void PromptEncoder::Loop() {
  std::unique_lock lock(mu_);
  while (true) {
    ready_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;   // stopping, and everything queued has run
    Job job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    const size_t bytes = job.text.size();
    {
      absl::StatusOr<std::vector<int32_t>> ids =
          EncodePrompt(tokenizer_, job.text, /*add_bos=*/false);
      std::string().swap(job.text);
      job.done(std::move(ids));
    }
    if (bytes >= kTrimAfterBytes) malloc_trim(0);
    lock.lock();
  }
}

}  // namespace tandem::gpu_worker
