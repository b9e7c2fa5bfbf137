#include "subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace tandem::multihost {
namespace {

using Clock = std::chrono::steady_clock;

// argv[0] as an executable path: as given when it has a '/', else the first match on $PATH or
// in the sbin folders (`ip` and `tc` live there and a test's PATH may lack them).
std::string Resolve(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  std::string dirs = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
  if (const char* path = std::getenv("PATH"); path != nullptr) dirs = absl::StrCat(path, ":", dirs);
  for (absl::string_view dir : absl::StrSplit(dirs, ':', absl::SkipEmpty())) {
    const std::string candidate = absl::StrCat(dir, "/", name);
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return name;
}

int DecodeWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// fork + exec with stdout and stderr on `out_fd`. Only async-signal-safe calls after fork: the
// test process has gRPC threads.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, int out_fd) {
  if (argv.empty()) return absl::InvalidArgumentError("empty command");
  const std::string path = Resolve(argv[0]);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);  // the parent died before prctl
    dup2(out_fd, STDOUT_FILENO);
    dup2(out_fd, STDERR_FILENO);
    // The child of a test with blocked signals would inherit the mask: unblock everything.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execv(path.c_str(), args.data());
    _exit(127);
  }
  return pid;
}

}  // namespace

std::string Tail(const std::string& text, size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  return absl::StrCat("...", text.substr(text.size() - max_bytes));
}

absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv,
                                         std::chrono::milliseconds timeout) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return absl::InternalError("pipe failed");
  absl::StatusOr<pid_t> pid = Spawn(argv, pipe_fds[1]);
  close(pipe_fds[1]);
  if (!pid.ok()) {
    close(pipe_fds[0]);
    return pid.status();
  }
  CommandResult result;
  const Clock::time_point deadline = Clock::now() + timeout;
  bool timed_out = false;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      timed_out = true;
      kill(*pid, SIGKILL);
      break;
    }
    pollfd p{pipe_fds[0], POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(left));
    if (ready < 0 && errno != EINTR) break;
    if (ready <= 0) continue;
    char buffer[4096];
    const ssize_t n = read(pipe_fds[0], buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // every writer closed: the command is done (or detached its output)
    result.output.append(buffer, static_cast<size_t>(n));
  }
  close(pipe_fds[0]);
  int status = 0;
  while (waitpid(*pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) {
    return absl::DeadlineExceededError(
        absl::StrCat("`", absl::StrJoin(argv, " "), "` ran past ", timeout.count(), " ms"));
  }
  result.exit_code = DecodeWaitStatus(status);
  if (result.exit_code == 127) {
    return absl::InternalError(absl::StrCat("cannot run ", argv[0], ": ", result.output));
  }
  return result;
}

absl::StatusOr<std::string> RunChecked(const std::vector<std::string>& argv) {
  absl::StatusOr<CommandResult> result = RunCommand(argv);
  if (!result.ok()) return result.status();
  if (result->exit_code != 0) {
    return absl::FailedPreconditionError(absl::StrCat("`", absl::StrJoin(argv, " "),
                                                      "` exited with ", result->exit_code, ": ",
                                                      Tail(result->output, 500)));
  }
  return std::move(result->output);
}

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(const std::vector<std::string>& argv,
                                                              const std::string& log_path) {
  const int log_fd =
      open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) {
    return absl::InternalError(
        absl::StrCat("cannot create ", log_path, ": ", std::strerror(errno)));
  }
  absl::StatusOr<pid_t> pid = Spawn(argv, log_fd);
  close(log_fd);
  if (!pid.ok()) return pid.status();
  std::unique_ptr<Subprocess> process(new Subprocess());
  process->pid_ = *pid;
  process->log_path_ = log_path;
  return process;
}

Subprocess::~Subprocess() {
  if (pid_ > 0 && !exit_code_.has_value()) {
    kill(pid_, SIGKILL);
    int status = 0;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

std::string Subprocess::log() const {
  std::ifstream in(log_path_, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool Subprocess::TryReap() {
  if (exit_code_.has_value()) return true;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r != pid_) return false;
  exit_code_ = DecodeWaitStatus(status);
  return true;
}

bool Subprocess::running() { return !TryReap(); }

void Subprocess::Signal(int signal) {
  if (!TryReap()) kill(pid_, signal);
}

absl::StatusOr<int> Subprocess::WaitExit(std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  while (!TryReap()) {
    if (Clock::now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("pid ", pid_, " still running after ", timeout.count(), " ms"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return *exit_code_;
}

absl::StatusOr<int> Subprocess::WaitListening(std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  for (;;) {
    const std::string text = log();
    std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
    lines.pop_back();  // an unterminated last line may still be growing
    for (absl::string_view line : lines) {
      int port = 0;
      if (absl::ConsumePrefix(&line, "LISTENING ") && absl::SimpleAtoi(line, &port)) return port;
    }
    if (TryReap()) {
      return absl::UnavailableError(absl::StrCat("pid ", pid_, " exited with ", *exit_code_,
                                                 " before LISTENING; log: ", Tail(text)));
    }
    if (Clock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("no LISTENING line from pid ", pid_, " in ",
                                                      timeout.count(), " ms; log: ", Tail(text)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace tandem::multihost
