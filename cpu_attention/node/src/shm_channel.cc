#include "tandem/cpu_attention/shm_channel.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace tandem::cpu_attention {
namespace {

constexpr uint64_t kMagic = 0x31304d4853444e54ull;  // "TNDSHM01" little-endian
constexpr uint32_t kVersion = 1;
constexpr uint64_t kAreaAlign = 4096;
// A server sleeping for requests wakes at least this often to notice Stop().
constexpr auto kStopSlice = std::chrono::milliseconds(50);
// A client waiting on a watched server checks that it still runs this often.
constexpr auto kPeerCheckSlice = std::chrono::milliseconds(2);

uint64_t AlignUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Shared (not private) futexes: the word lives in a MAP_SHARED mapping seen by two processes.
void FutexWait(uint32_t* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  if (timeout.count() <= 0) return;
  timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1'000'000'000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1'000'000'000);
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWake(uint32_t* word) {
  syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

uint32_t Load(uint32_t* word) {
  return std::atomic_ref<uint32_t>(*word).load(std::memory_order_seq_cst);
}
void Store(uint32_t* word, uint32_t value) {
  std::atomic_ref<uint32_t>(*word).store(value, std::memory_order_seq_cst);
}
uint64_t Load64(uint64_t* word) {
  return std::atomic_ref<uint64_t>(*word).load(std::memory_order_acquire);
}
void Store64(uint64_t* word, uint64_t value) {
  std::atomic_ref<uint64_t>(*word).store(value, std::memory_order_release);
}

std::string ErrnoText(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

}  // namespace

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Create(const ShmChannelOptions& options) {
  if (options.request_capacity == 0 || options.request_capacity > kMaxAreaBytes ||
      options.response_capacity == 0 || options.response_capacity > kMaxAreaBytes) {
    return absl::InvalidArgumentError(absl::StrCat("shm areas must be 1..", kMaxAreaBytes,
                                                   " bytes, got request ", options.request_capacity,
                                                   " and response ", options.response_capacity));
  }
  static std::atomic<uint64_t> counter{0};
  std::unique_ptr<ShmChannel> ch(new ShmChannel());
  ch->creator_ = true;
  ch->spin_us_ = options.spin_us;
  ch->request_offset_ = kHeaderBytes;
  ch->request_capacity_ = options.request_capacity;
  ch->response_offset_ = AlignUp(kHeaderBytes + options.request_capacity, kAreaAlign);
  ch->response_capacity_ = options.response_capacity;
  ch->segment_bytes_ = AlignUp(ch->response_offset_ + options.response_capacity, kAreaAlign);
  ch->nonce_ = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);

  int fd = -1;
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    ch->name_ = absl::StrCat("/tandem-", getpid(), "-", counter.fetch_add(1));
    fd = shm_open(ch->name_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) return absl::InternalError(ErrnoText("shm_open"));
  }
  if (fd < 0) return absl::InternalError("shm_open: no free segment name");
  ch->unlinked_ = false;
  if (ftruncate(fd, static_cast<off_t>(ch->segment_bytes_)) != 0) {
    const absl::Status error = absl::InternalError(ErrnoText("ftruncate"));
    close(fd);
    return error;  // the destructor unlinks the name
  }
  // Reserve the pages now: a tmpfs that is too small (a container's 64 MiB /dev/shm) fails
  // here with a status instead of a SIGBUS on the first write past its end.
  if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(ch->segment_bytes_)); err != 0) {
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("cannot reserve ", ch->segment_bytes_,
                                                     " bytes of shared memory for ", ch->name_,
                                                     ": ", std::strerror(err)));
  }
  void* base = mmap(nullptr, ch->segment_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return absl::InternalError(ErrnoText("mmap"));
  ch->base_ = static_cast<std::byte*>(base);

  static_assert(sizeof(Header) <= kHeaderBytes);
  Header* h = ch->header();  // the fresh segment is zero-filled
  h->version = kVersion;
  h->header_bytes = kHeaderBytes;
  h->segment_bytes = ch->segment_bytes_;
  h->nonce = ch->nonce_;
  h->request_offset = ch->request_offset_;
  h->request_capacity = ch->request_capacity_;
  h->response_offset = ch->response_offset_;
  h->response_capacity = ch->response_capacity_;
  std::atomic_ref<uint64_t>(h->magic).store(kMagic, std::memory_order_release);
  return ch;
}

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Attach(const std::string& name,
                                                               uint64_t segment_bytes,
                                                               uint64_t nonce, uint32_t spin_us) {
  if (name.size() < 2 || name.size() > 200 || name[0] != '/' ||
      name.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("bad shm name '", name, "'"));
  }
  if (segment_bytes < kHeaderBytes + 2 || segment_bytes > 2 * kMaxAreaBytes + 2 * kHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("bad shm segment size ", segment_bytes));
  }
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat("no shm segment '", name, "' on this host"));
    }
    return absl::InvalidArgumentError(ErrnoText("shm_open"));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != segment_bytes) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("shm segment '", name, "' is not ", segment_bytes, " bytes"));
  }
  void* base = mmap(nullptr, segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return absl::InvalidArgumentError(ErrnoText("mmap"));
  std::unique_ptr<ShmChannel> ch(new ShmChannel());
  ch->name_ = name;
  ch->base_ = static_cast<std::byte*>(base);
  ch->segment_bytes_ = segment_bytes;
  ch->spin_us_ = spin_us;

  // Read the geometry once, then check it against the mapped size.
  Header* h = ch->header();
  if (std::atomic_ref<uint64_t>(h->magic).load(std::memory_order_acquire) != kMagic ||
      h->version != kVersion || h->nonce != nonce) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm segment '", name, "' has a foreign header (magic, version or nonce)"));
  }
  ch->nonce_ = nonce;
  ch->request_offset_ = h->request_offset;
  ch->request_capacity_ = h->request_capacity;
  ch->response_offset_ = h->response_offset;
  ch->response_capacity_ = h->response_capacity;
  auto inside = [&](uint64_t offset, uint64_t capacity) {
    return offset >= kHeaderBytes && offset % 64 == 0 && capacity > 0 &&
           capacity <= kMaxAreaBytes && offset <= segment_bytes &&
           capacity <= segment_bytes - offset;
  };
  const bool overlap = ch->request_offset_ < ch->response_offset_ + ch->response_capacity_ &&
                       ch->response_offset_ < ch->request_offset_ + ch->request_capacity_;
  if (!inside(ch->request_offset_, ch->request_capacity_) ||
      !inside(ch->response_offset_, ch->response_capacity_) || overlap) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm segment '", name, "' has areas outside the segment or overlapping"));
  }
  std::atomic_ref<int32_t>(h->server_pid)
      .store(static_cast<int32_t>(getpid()), std::memory_order_release);
  Store(&h->attached, 1);
  return ch;
}

ShmChannel::~ShmChannel() {
  if (pidfd_ >= 0) close(pidfd_);
  if (base_ != nullptr) munmap(base_, segment_bytes_);
  Unlink();
}

void ShmChannel::Unlink() {
  if (creator_ && !unlinked_) {
    shm_unlink(name_.c_str());
    unlinked_ = true;
  }
}

bool ShmChannel::PeerAttached() const { return Load(&header()->attached) != 0; }

bool ShmChannel::WatchPeer() {
  if (!creator_ || pidfd_ >= 0 || !PeerAttached()) return pidfd_ >= 0;
  // Written by the peer: only a hint until /proc confirms that this process maps our segment
  // (pids of another pid namespace may name an unrelated process here).
  const int32_t pid =
      std::atomic_ref<int32_t>(header()->server_pid).load(std::memory_order_acquire);
  if (pid <= 0) return false;
  const int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) return false;
  bool maps_segment = false;
  if (FILE* maps = std::fopen(absl::StrCat("/proc/", pid, "/maps").c_str(), "re")) {
    const std::string needle = absl::StrCat("/dev/shm", name_);
    char line[4096];
    while (!maps_segment && std::fgets(line, sizeof(line), maps) != nullptr) {
      maps_segment = std::strstr(line, needle.c_str()) != nullptr;
    }
    std::fclose(maps);
  }
  if (!maps_segment) {
    close(fd);
    return false;
  }
  pidfd_ = fd;
  return true;
}

bool ShmChannel::PeerExited() const {
  if (pidfd_ < 0) return false;
  pollfd p{pidfd_, POLLIN, 0};  // a pidfd becomes readable when its process exits
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

bool ShmChannel::WaitChange(uint32_t* word, uint32_t old, uint32_t* waiting,
                            Clock::time_point until, bool* stop_flag) {
  auto stopped = [stop_flag] {
    return stop_flag != nullptr &&
           std::atomic_ref<bool>(*stop_flag).load(std::memory_order_acquire);
  };
  const Clock::time_point spin_until =
      std::min(until, Clock::now() + std::chrono::microseconds(spin_us_));
  for (uint32_t i = 0;; ++i) {
    if (Load(word) != old) return true;
    if ((i & 63) == 63) {
      if (stopped() || PeerExited()) return false;
      if (Clock::now() >= spin_until) break;
    }
    CpuRelax();
  }
  const Clock::duration slice =
      pidfd_ >= 0 ? Clock::duration(kPeerCheckSlice) : Clock::duration(kStopSlice);
  for (;;) {
    if (stopped()) return false;
    if (PeerExited()) return Load(word) != old;
    const Clock::time_point now = Clock::now();
    if (now >= until) return Load(word) != old;
    // Announce the sleep before the last check: the peer stores the word, then reads `waiting`
    // (both sequentially consistent), so either it sees us waiting or we see its store.
    Store(waiting, 1);
    if (Load(word) != old) {
      Store(waiting, 0);
      return true;
    }
    FutexWait(word, old, std::min<Clock::duration>(until - now, slice));
    Store(waiting, 0);
    if (Load(word) != old) return true;
  }
}

absl::Status ShmChannel::Send(uint64_t bytes) {
  if (bytes > request_capacity_) {
    return absl::InvalidArgumentError(
        absl::StrCat("request of ", bytes, " bytes exceeds the shm area of ", request_capacity_));
  }
  if (Busy()) {
    return absl::FailedPreconditionError("the previous shm request is still unanswered");
  }
  Header* h = header();
  Store64(&h->request_bytes, bytes);
  Store(&h->request_seq, ++last_sent_);
  if (Load(&h->server_waiting) != 0) FutexWake(&h->request_seq);
  return absl::OkStatus();
}

bool ShmChannel::Busy() const { return Load(&header()->response_seq) != last_sent_; }

absl::StatusOr<std::span<const std::byte>> ShmChannel::WaitResponse(Clock::time_point deadline) {
  Header* h = header();
  // The server answers with the sequence it read; wait until it is ours.
  for (;;) {
    const uint32_t seen = Load(&h->response_seq);
    if (seen == last_sent_) break;
    if (!WaitChange(&h->response_seq, seen, &h->client_waiting, deadline, nullptr)) {
      if (PeerExited()) {
        return absl::UnavailableError("the shm peer process exited without answering");
      }
      return absl::DeadlineExceededError("the shm peer did not answer before the deadline");
    }
  }
  const uint64_t bytes = Load64(&h->response_bytes);
  if (bytes > response_capacity_) {
    return absl::DataLossError(absl::StrCat("the shm peer wrote a response of ", bytes,
                                            " bytes into an area of ", response_capacity_));
  }
  return std::span<const std::byte>(base_ + response_offset_, bytes);
}

absl::StatusOr<std::span<const std::byte>> ShmChannel::WaitRequest() {
  Header* h = header();
  for (;;) {
    const uint32_t seen = Load(&h->request_seq);
    if (seen != last_request_) {
      last_request_ = seen;
      break;
    }
    WaitChange(&h->request_seq, seen, &h->server_waiting, Clock::time_point::max(), &stop_);
    if (std::atomic_ref<bool>(stop_).load(std::memory_order_acquire)) {
      return absl::CancelledError("shm channel stopped");
    }
  }
  const uint64_t bytes = Load64(&h->request_bytes);
  if (bytes > request_capacity_) {
    return absl::InvalidArgumentError(
        absl::StrCat("request of ", bytes, " bytes exceeds the shm area of ", request_capacity_));
  }
  return std::span<const std::byte>(base_ + request_offset_, bytes);
}

void ShmChannel::Reply(uint64_t bytes) {
  Header* h = header();
  Store64(&h->response_bytes, std::min(bytes, response_capacity_));
  Store(&h->response_seq, last_request_);
  if (Load(&h->client_waiting) != 0) FutexWake(&h->response_seq);
}

void ShmChannel::Stop() {
  std::atomic_ref<bool>(stop_).store(true, std::memory_order_release);
  if (base_ != nullptr) FutexWake(&header()->request_seq);
}

}  // namespace tandem::cpu_attention
