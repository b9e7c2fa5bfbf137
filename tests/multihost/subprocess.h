// Child processes for the multi-host test harness: a long-running server whose stdout and stderr
// go to a log file (a file never fills up and blocks the child the way an unread pipe does), and
// short commands (`ip`, `tc`) run to completion with their output captured.
//
// Children get PR_SET_PDEATHSIG(SIGKILL): when the thread that started them dies (the test
// process crashed or was killed by ctest's timeout), they die too, so no node outlives its test.
// Hence: start them from a thread that outlives them (a test's main thread).
//
// Not thread-safe; one owner.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::multihost {

struct CommandResult {
  int exit_code = -1;  // 128 + signal for a signal death
  std::string output;  // stdout and stderr, interleaved
};

// Runs argv (argv[0] found on PATH, else in /usr/sbin and /sbin) to its end. INTERNAL when it
// cannot be started, DEADLINE_EXCEEDED (the child is killed) when it runs past `timeout`.
absl::StatusOr<CommandResult> RunCommand(
    const std::vector<std::string>& argv,
    std::chrono::milliseconds timeout = std::chrono::seconds(30));

// RunCommand that also turns a non-zero exit into FAILED_PRECONDITION naming the command and
// its output.
absl::StatusOr<std::string> RunChecked(const std::vector<std::string>& argv);

class Subprocess {
 public:
  // Starts argv with stdout and stderr appended to `log_path` (created or truncated).
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(const std::vector<std::string>& argv,
                                                           const std::string& log_path);
  ~Subprocess();  // SIGKILL and reap when still running

  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  // Waits for a line "LISTENING <port>" in the log (tandem servers print it once bound) and
  // returns the port. UNAVAILABLE with the log's tail when the child exits first,
  // DEADLINE_EXCEEDED after `timeout`.
  absl::StatusOr<int> WaitListening(std::chrono::milliseconds timeout);

  // Sends `signal` unless the child was already reaped (then a no-op).
  void Signal(int signal);
  // The exit status once the child has exited (reaping it), DEADLINE_EXCEEDED while it still runs
  // after `timeout`. Repeatable: later calls return the same status.
  absl::StatusOr<int> WaitExit(std::chrono::milliseconds timeout);
  bool running();  // reaps without waiting

  pid_t pid() const { return pid_; }
  std::string log() const;  // the whole log so far
  const std::string& log_path() const { return log_path_; }

 private:
  Subprocess() = default;
  bool TryReap();

  pid_t pid_ = -1;
  std::optional<int> exit_code_;
  std::string log_path_;
};

// The last `max_bytes` of `text`, for error messages.
std::string Tail(const std::string& text, size_t max_bytes = 2000);

}  // namespace tandem::multihost
