// Real binaries started by tests: a child process with its stdout (and optionally stderr) on
// pipes, the "LISTENING <port>" handshake of tandem's servers, signals, and the exit status;
// SIGKILL + waitpid on destruction. Used by the service tests and the node's drain tests.
// (tests/multihost has its own Subprocess: its children log to files and die with the test
// thread, PR_SET_PDEATHSIG, which namespaced nodes need.)
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace tandem::test_process {

class ChildProcess {
 public:
  // Starts argv[0] (a path) with argv. stdout is piped; stderr is piped too when
  // `capture_stderr`, else inherited (a server's logs land in the test's output).
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(const std::vector<std::string>& argv,
                                                             bool capture_stderr = false) {
    int out[2], err[2] = {-1, -1};
    if (pipe2(out, O_CLOEXEC) != 0) return absl::InternalError("pipe failed");
    if (capture_stderr && pipe2(err, O_CLOEXEC) != 0) return absl::InternalError("pipe failed");
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError("fork failed");
    if (pid == 0) {
      dup2(out[1], STDOUT_FILENO);
      if (capture_stderr) dup2(err[1], STDERR_FILENO);
      execv(args[0], args.data());
      _exit(127);
    }
    close(out[1]);
    if (capture_stderr) close(err[1]);
    std::unique_ptr<ChildProcess> child(new ChildProcess());
    child->pid_ = pid;
    child->stdout_fd_ = out[0];
    child->stderr_fd_ = err[0];
    return child;
  }

  ~ChildProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (stdout_fd_ >= 0) close(stdout_fd_);
    if (stderr_fd_ >= 0) close(stderr_fd_);
  }

  // Reads stdout until a line "LISTENING <port>"; returns the port.
  absl::StatusOr<int> WaitListening(int timeout_ms = 60000) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      size_t eol;
      while ((eol = stdout_.find('\n')) != std::string::npos) {
        const std::string line = stdout_.substr(0, eol);
        stdout_.erase(0, eol + 1);
        int port = 0;
        if (absl::StartsWith(line, "LISTENING ") && absl::SimpleAtoi(line.substr(10), &port)) {
          return port;
        }
      }
      const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                            deadline - std::chrono::steady_clock::now())
                                            .count());
      if (left <= 0) return absl::DeadlineExceededError("no LISTENING line in time");
      if (!ReadSome(stdout_fd_, &stdout_, left)) {
        return absl::UnavailableError(
            absl::StrCat("the child exited before LISTENING; stdout: ", stdout_));
      }
    }
  }

  void Signal(int sig) {
    if (pid_ > 0) kill(pid_, sig);
  }

  // True while the child has not exited (reaps it, without waiting, when it has). Reads what
  // the pipes hold meanwhile, so a chatty child never blocks on a full pipe.
  bool Running() {
    Drain();
    if (pid_ <= 0) return false;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) != pid_) return true;
    exit_code_ = DecodeStatus(status);
    pid_ = -1;
    return false;
  }

  // Reads stdout (and stderr when captured) to their end, then waits for the exit. Returns the
  // exit status (128 + signal for a signal death), or DEADLINE_EXCEEDED (the child is killed).
  absl::StatusOr<int> Wait(int timeout_ms = 120000) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    bool out_open = stdout_fd_ >= 0, err_open = stderr_fd_ >= 0;
    while (out_open || err_open) {
      const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                            deadline - std::chrono::steady_clock::now())
                                            .count());
      if (left <= 0) {
        Signal(SIGKILL);
        return absl::DeadlineExceededError("the child did not finish in time");
      }
      pollfd fds[2] = {{out_open ? stdout_fd_ : -1, POLLIN, 0},
                       {err_open ? stderr_fd_ : -1, POLLIN, 0}};
      if (poll(fds, 2, left) < 0 && errno != EINTR) return absl::InternalError("poll failed");
      if (out_open && fds[0].revents != 0) out_open = ReadSome(stdout_fd_, &stdout_, 0);
      if (err_open && fds[1].revents != 0) err_open = ReadSome(stderr_fd_, &stderr_, 0);
    }
    return Reap();
  }

  // SIGTERM, then the exit status as Wait() gives it.
  absl::StatusOr<int> Terminate(int timeout_ms = 30000) {
    Signal(SIGTERM);
    return Wait(timeout_ms);
  }

  // What the child printed so far (stdout: what WaitListening has not consumed).
  pid_t pid() const { return pid_; }
  const std::string& stdout_text() const { return stdout_; }
  const std::string& stderr_text() const { return stderr_; }
  std::string log() const { return stdout_ + stderr_; }

 private:
  ChildProcess() = default;

  // Reads what the open pipes hold now; closes a pipe at its end of file.
  void Drain() {
    for (auto [fd, text] : {std::pair{&stdout_fd_, &stdout_}, std::pair{&stderr_fd_, &stderr_}}) {
      if (*fd < 0) continue;
      for (pollfd p{*fd, POLLIN, 0}; poll(&p, 1, 0) > 0 && p.revents != 0; p.revents = 0) {
        if (!ReadSome(*fd, text, 0)) {
          close(*fd);
          *fd = -1;
          break;
        }
      }
    }
  }

  static int DecodeStatus(int status) {
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return -1;
  }

  // Appends what is available within `timeout_ms` (0: what is there now, after poll said so).
  // False at end of file.
  static bool ReadSome(int fd, std::string* dst, int timeout_ms) {
    if (timeout_ms > 0) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, timeout_ms) <= 0) return true;
    }
    char buffer[4096];
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0) return errno == EINTR || errno == EAGAIN;
    if (n == 0) return false;
    dst->append(buffer, static_cast<size_t>(n));
    return true;
  }

  absl::StatusOr<int> Reap() {
    if (pid_ <= 0) return exit_code_;   // reaped by Running()
    int status = 0;
    if (waitpid(pid_, &status, 0) != pid_) return absl::InternalError("waitpid failed");
    pid_ = -1;
    exit_code_ = DecodeStatus(status);
    if (exit_code_ < 0) return absl::InternalError("unexpected wait status");
    return exit_code_;
  }

  pid_t pid_ = -1;
  int exit_code_ = -1;   // once reaped
  int stdout_fd_ = -1, stderr_fd_ = -1;
  std::string stdout_, stderr_;
};

// Runs a command to its end: exit status, stdout and stderr.
struct CommandResult {
  int exit_code = -1;
  std::string out, err;
};

inline absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv,
                                                int timeout_ms = 120000) {
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Start(argv, true);
  if (!child.ok()) return child.status();
  absl::StatusOr<int> code = (*child)->Wait(timeout_ms);
  if (!code.ok()) return code.status();
  return CommandResult{*code, (*child)->stdout_text(), (*child)->stderr_text()};
}

}  // namespace tandem::test_process
