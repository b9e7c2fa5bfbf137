#include "tandem/gpu_worker/lost_sessions.h"

#include <iterator>
#include <utility>

namespace tandem::gpu_worker {

void LostSessions::Remember(const std::string& id, std::string reason) {
  if (capacity_ == 0) return;
  Forget(id);
  if (reasons_.size() >= capacity_) {
    reasons_.erase(oldest_first_.front());
    oldest_first_.pop_front();
  }
  oldest_first_.push_back(id);
  reasons_.emplace(id, Entry{std::move(reason), std::prev(oldest_first_.end())});
}

std::optional<std::string> LostSessions::Take(const std::string& id) {
  auto it = reasons_.find(id);
  if (it == reasons_.end()) return std::nullopt;
  std::string reason = std::move(it->second.reason);
  oldest_first_.erase(it->second.age);
  reasons_.erase(it);
  return reason;
}

bool LostSessions::Forget(const std::string& id) {
  return Take(id).has_value();
}

}  // namespace tandem::gpu_worker
