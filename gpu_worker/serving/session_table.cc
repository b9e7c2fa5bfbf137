#include "tandem/gpu_worker/session_table.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace tandem::gpu_worker {

Sequence* SessionTable::Find(const std::string& id) {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : it->second.get();
}

const Sequence* SessionTable::Find(const std::string& id) const {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : it->second.get();
}

Sequence& SessionTable::Add(std::unique_ptr<Sequence> seq) {
  Sequence& added = *seq;
  sessions_[added.id] = std::move(seq);
  return added;
}

absl::Status SessionTable::Close(const std::string& id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return absl::NotFoundError(absl::StrCat("no session '", id, "'"));
  absl::Status closed = it->second->CloseOffloaded();
  kept_.erase(id);
  sessions_.erase(it);
  return closed;
}

void SessionTable::CloseLost(const std::string& id, const std::string& reason) {
  if (!contains(id)) return;
  spdlog::warn("session {}: closed, {}", id, reason);
  (void)Close(id);
  lost_.Remember(id, reason);
}

Generation* SessionTable::running(const std::string& id) const {
  auto it = running_.find(id);
  return it == running_.end() ? nullptr : it->second;
}

size_t SessionTable::DeviceBytes() const {
  return DeviceBytes([](const std::string&, const Sequence&) { return true; });
}

}  // namespace tandem::gpu_worker
