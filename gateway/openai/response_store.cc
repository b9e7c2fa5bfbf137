#include "response_store.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace tandem::gateway {
namespace {

absl::Status NotFound(const std::string& id) {
  return absl::NotFoundError(absl::StrCat("Response with id '", id, "' not found."));
}

// Bytes an entry holds, as its JSON text (the in-memory form is a small multiple of it).
size_t SizeOf(const ResponseStore::Entry& entry) {
  constexpr auto kReplace = nlohmann::ordered_json::error_handler_t::replace;
  return entry.principal.size() + entry.conversation.dump(-1, ' ', false, kReplace).size() +
         entry.response.dump(-1, ' ', false, kReplace).size();
}

}  // namespace

bool ResponseStore::Put(const std::string& id, Entry entry) {
  const size_t size = SizeOf(entry) + id.size();
  if (size > max_bytes_ || max_entries_ == 0) return false;
  std::lock_guard lock(mu_);
  if (auto it = slots_.find(id); it != slots_.end()) EraseLocked(it);
  lru_.push_front(id);
  slots_.emplace(id, Slot{std::make_shared<const Entry>(std::move(entry)), size, lru_.begin()});
  bytes_ += size;
  while (slots_.size() > max_entries_ || bytes_ > max_bytes_) {
    EraseLocked(slots_.find(lru_.back()));
  }
  return true;
}

absl::StatusOr<std::shared_ptr<const ResponseStore::Entry>> ResponseStore::Get(
    const std::string& id, const std::string& principal) {
  std::lock_guard lock(mu_);
  auto it = slots_.find(id);
  if (it == slots_.end() || it->second.entry->principal != principal) return NotFound(id);
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  return it->second.entry;
}

absl::Status ResponseStore::Delete(const std::string& id, const std::string& principal) {
  std::lock_guard lock(mu_);
  auto it = slots_.find(id);
  if (it == slots_.end() || it->second.entry->principal != principal) return NotFound(id);
  EraseLocked(it);
  return absl::OkStatus();
}

size_t ResponseStore::entries() const {
  std::lock_guard lock(mu_);
  return slots_.size();
}

size_t ResponseStore::bytes() const {
  std::lock_guard lock(mu_);
  return bytes_;
}

void ResponseStore::EraseLocked(std::unordered_map<std::string, Slot>::iterator it) {
  bytes_ -= it->second.bytes;
  lru_.erase(it->second.lru);
  slots_.erase(it);
}

}  // namespace tandem::gateway
