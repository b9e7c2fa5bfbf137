// StopMatcher: finds stop strings in streamed text without ever emitting a stop string or a part
// of one. Text that could still become the start of a stop string is held back until the next
// piece decides it.
#pragma once

#include <string>
#include <vector>

namespace tandem::gpu_worker {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}

  // Adds `piece`; returns the text that is now safe to emit. Sets stopped() when a stop string
  // appeared: the returned text then ends right before it and nothing more is emitted.
  std::string Push(const std::string& piece) {
    if (stopped_) return "";
    held_ += piece;
    size_t first = std::string::npos;
    for (const std::string& s : stops_) {
      const size_t at = held_.find(s);
      if (at != std::string::npos && (first == std::string::npos || at < first)) first = at;
    }
    if (first != std::string::npos) {
      stopped_ = true;
      std::string out = held_.substr(0, first);
      held_.clear();
      return out;
    }
    // Keep the longest suffix of held_ that is a proper prefix of some stop string.
    size_t keep = 0;
    for (const std::string& s : stops_) {
      for (size_t len = std::min(s.size() - 1, held_.size()); len > keep; --len) {
        if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
          keep = len;
          break;
        }
      }
    }
    std::string out = held_.substr(0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
    return out;
  }

  // The held-back text, once generation ends for another reason.
  std::string Flush() {
    std::string out = stopped_ ? "" : held_;
    held_.clear();
    return out;
  }

  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace tandem::gpu_worker
