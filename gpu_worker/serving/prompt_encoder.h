// Prompt text -> token ids on a small pool of threads, off the scheduler thread and off gRPC's
// callback threads, so that one large prompt being tokenized (seconds for megabytes) delays
// nobody else's steps. A text that cannot fit the model's context is refused before it is
// tokenized (CheckPromptTextFits: microseconds), and after a large text the freed heap is
// returned to the system (malloc_trim), so one big request does not leave the worker's RSS high.
//
// Thread-safe. The destructor runs what is queued, then joins.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/tokenizer.h"

namespace tandem::gpu_worker {

class PromptEncoder {
 public:
  using Done = std::function<void(absl::StatusOr<std::vector<int32_t>> ids)>;

  // `tokenizer` must outlive the encoder. threads >= 1; max_queued: texts waiting beyond this
  // are refused (RESOURCE_EXHAUSTED) instead of queued without bound.
  PromptEncoder(const Tokenizer& tokenizer, int64_t max_context, int threads = 2,
                size_t max_queued = 256);
  ~PromptEncoder();
  PromptEncoder(const PromptEncoder&) = delete;
  PromptEncoder& operator=(const PromptEncoder&) = delete;

  // INVALID_ARGUMENT when `text` cannot fit the context (nothing is queued then).
  absl::Status CheckFits(const std::string& text) const;

  // Tokenizes `text` (EncodePrompt with add_bos = false) on a pool thread and calls `done` there
  // with the ids or the error. Returns RESOURCE_EXHAUSTED (without calling `done`) when the queue
  // is full, UNAVAILABLE while shutting down.
  absl::Status Encode(std::string text, Done done);

 private:
  struct Job {
    std::string text;
    Done done;
  };
  void Loop();

  const Tokenizer& tokenizer_;
  const int64_t max_context_;
  const size_t max_token_bytes_;
  const size_t max_queued_;
  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<Job> queue_;   // guarded by mu_
  bool stop_ = false;       // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace tandem::gpu_worker
