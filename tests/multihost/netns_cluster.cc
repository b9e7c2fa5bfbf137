#include "netns_cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "subprocess.h"
#include "tandem/common/status_macros.h"

namespace tandem::multihost {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kRangeBase = (198u << 24) | (18u << 16);  // 198.18.0.0/15
constexpr uint32_t kBlocks = 1024;                           // /25 blocks in the range
constexpr uint32_t kBlockAddresses = 128;
constexpr size_t kMaxNodes = kBlockAddresses / 4;  // one /30 per node

std::string Ipv4(uint32_t address) {
  return absl::StrCat(address >> 24, ".", (address >> 16) & 255, ".", (address >> 8) & 255, ".",
                      address & 255);
}

// "a.b.c.d" or "a.b.c.d/len" to (address, prefix length); nullopt for anything else.
std::optional<std::pair<uint32_t, int>> ParsePrefix(absl::string_view text) {
  int length = 32;
  if (const size_t slash = text.find('/'); slash != absl::string_view::npos) {
    if (!absl::SimpleAtoi(text.substr(slash + 1), &length) || length < 0 || length > 32) {
      return std::nullopt;
    }
    text = text.substr(0, slash);
  }
  in_addr parsed{};
  if (inet_pton(AF_INET, std::string(text).c_str(), &parsed) != 1) return std::nullopt;
  return std::make_pair(ntohl(parsed.s_addr), length);
}

bool Overlaps(std::pair<uint32_t, int> a, std::pair<uint32_t, int> b) {
  const int common = std::min(a.second, b.second);
  if (common == 0) return true;
  const uint32_t mask = ~uint32_t{0} << (32 - common);
  return (a.first & mask) == (b.first & mask);
}

// Set while a cluster of this process exists: its names carry only the pid.
std::atomic<bool> g_cluster_alive{false};

bool PidAlive(pid_t pid) { return kill(pid, 0) == 0 || errno == EPERM; }

// The pid in a harness name "tdm<pid><kind>...", when `kinds` holds <kind>; else -1.
pid_t OwnerPid(absl::string_view name, absl::string_view kinds) {
  if (!absl::ConsumePrefix(&name, "tdm")) return -1;
  size_t digits = 0;
  while (digits < name.size() && absl::ascii_isdigit(name[digits])) ++digits;
  if (digits == 0 || digits == name.size() || kinds.find(name[digits]) == absl::string_view::npos) {
    return -1;
  }
  int pid = 0;
  if (!absl::SimpleAtoi(name.substr(0, digits), &pid) || pid <= 0) return -1;
  return pid;
}

// Whether what harness name `name` belongs to is gone: its process no longer runs, or it is this
// process's pid (so the leftover is from an earlier process that had the same pid).
bool Stale(pid_t owner) { return owner > 0 && (owner == getpid() || !PidAlive(owner)); }

// Removes tdm* namespaces, links and log folders whose creating process is gone, SIGKILLing what
// still runs inside those namespaces. Best effort: a failure here surfaces later as a clear AddNode
// error.
void RemoveStaleLeftovers() {
  if (absl::StatusOr<std::string> list = RunChecked({"ip", "netns", "list"}); list.ok()) {
    for (absl::string_view line : absl::StrSplit(*list, '\n', absl::SkipEmpty())) {
      const std::string ns(line.substr(0, line.find(' ')));
      if (!Stale(OwnerPid(ns, "nx"))) continue;
      if (absl::StatusOr<std::string> pids = RunChecked({"ip", "netns", "pids", ns}); pids.ok()) {
        for (absl::string_view p : absl::StrSplit(*pids, '\n', absl::SkipEmpty())) {
          int pid = 0;
          if (absl::SimpleAtoi(p, &pid) && pid > 1) kill(pid, SIGKILL);
        }
      }
      (void)RunCommand({"ip", "netns", "del", ns});
    }
  }
  if (absl::StatusOr<std::string> links = RunChecked({"ip", "-o", "link", "show"}); links.ok()) {
    for (absl::string_view line : absl::StrSplit(*links, '\n', absl::SkipEmpty())) {
      // "12: tdm123h0@if11: <BROADCAST,...> ..."
      std::vector<absl::string_view> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (fields.size() < 2) continue;
      absl::string_view name = fields[1];
      name = name.substr(0, name.find_first_of("@:"));
      if (Stale(OwnerPid(name, "hv"))) (void)RunCommand({"ip", "link", "del", std::string(name)});
    }
  }
  // Log folders "/tmp/tdm<pid>-XXXXXX".
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/tmp", error)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory(error) && Stale(OwnerPid(name, "-"))) {
      std::filesystem::remove_all(entry.path(), error);
    }
  }
}

// Every IPv4 address and route prefix on this machine (root namespace).
std::vector<std::pair<uint32_t, int>> UsedPrefixes() {
  std::vector<std::pair<uint32_t, int>> used;
  if (absl::StatusOr<std::string> out = RunChecked({"ip", "-4", "-o", "addr", "show"}); out.ok()) {
    // "2: eth0    inet 192.0.2.2/24 brd ..."
    for (absl::string_view line : absl::StrSplit(*out, '\n', absl::SkipEmpty())) {
      std::vector<absl::string_view> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
      for (size_t i = 0; i + 1 < fields.size(); ++i) {
        if (fields[i] != "inet") continue;
        if (auto prefix = ParsePrefix(fields[i + 1])) used.push_back(*prefix);
      }
    }
  }
  if (absl::StatusOr<std::string> out = RunChecked({"ip", "-4", "route", "show", "table", "all"});
      out.ok()) {
    // "10.0.0.0/8 via ..." or "local 10.1.2.3 dev ..." or "default via ..."
    for (absl::string_view line : absl::StrSplit(*out, '\n', absl::SkipEmpty())) {
      std::vector<absl::string_view> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
      for (size_t i = 0; i < fields.size() && i < 2; ++i) {
        if (auto prefix = ParsePrefix(fields[i])) {
          used.push_back(*prefix);
          break;
        }
      }
    }
  }
  return used;
}

// A TCP connect to "ip:port" from this (root) namespace succeeds within `timeout`.
absl::Status WaitConnectable(const std::string& ip, int port, std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  std::string last_error = "timeout";
  for (;;) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::InternalError("socket failed");
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, ip.c_str(), &address.sin_addr);
    int rc = connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      if (poll(&p, 1, 500) == 1) {
        int error = 0;
        socklen_t len = sizeof(error);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
        errno = error;
        rc = error == 0 ? 0 : -1;
      } else {
        errno = ETIMEDOUT;
      }
    }
    if (rc != 0) last_error = std::strerror(errno);
    close(fd);
    if (rc == 0) return absl::OkStatus();
    if (Clock::now() >= deadline) {
      return absl::UnavailableError(absl::StrCat("cannot connect to ", ip, ":", port,
                                                 " from the root namespace: ", last_error));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

const char* LatencyMechanismName(LatencyMechanism mechanism) {
  switch (mechanism) {
    case LatencyMechanism::kNone:
      return "none";
    case LatencyMechanism::kNetem:
      return "netem";
    case LatencyMechanism::kProxy:
      return "proxy";
  }
  return "?";
}

struct NetnsCluster::Node {
  std::string ns, host_if, ns_if, host_ip, ns_ip, address;
  LatencyMechanism latency = LatencyMechanism::kNone;
  bool ns_created = false, link_created = false;
  std::unique_ptr<Subprocess> process;  // tandem-cpu-attention (as `ip netns exec` execs it)
  std::unique_ptr<Subprocess> proxy;    // tandem-delay-proxy, with LatencyMechanism::kProxy
};

NetnsCluster::NetnsCluster(ClusterOptions options) : options_(std::move(options)), pid_(getpid()) {
  if (options_.node_binary.empty()) options_.node_binary = TANDEM_CPU_ATTENTION_BIN;
  if (options_.proxy_binary.empty()) options_.proxy_binary = TANDEM_DELAY_PROXY_BIN;
}

absl::StatusOr<std::unique_ptr<NetnsCluster>> NetnsCluster::Create(ClusterOptions options) {
  if (geteuid() != 0) {
    return absl::FailedPreconditionError(
        "network namespaces need root (run the multihost tests as root)");
  }
  if (g_cluster_alive.exchange(true)) {
    return absl::AlreadyExistsError("this process already has a NetnsCluster");
  }
  // From here the destructor (of `cluster`) clears the flag on every return.
  std::unique_ptr<NetnsCluster> cluster(new NetnsCluster(std::move(options)));
  for (const std::string& binary :
       {cluster->options_.node_binary, cluster->options_.proxy_binary}) {
    if (access(binary.c_str(), X_OK) != 0) {
      return absl::NotFoundError(absl::StrCat(binary, " is not an executable (build it first)"));
    }
  }
  absl::StatusOr<CommandResult> ip = RunCommand({"ip", "-V"});
  if (!ip.ok() || ip->exit_code != 0) {
    return absl::FailedPreconditionError("the `ip` tool (iproute2) is missing");
  }
  RemoveStaleLeftovers();
  // Probe: can this process create a namespace and a veth pair?
  const std::string probe_ns = absl::StrCat("tdm", cluster->pid_, "x");
  const std::string probe_if = absl::StrCat("tdm", cluster->pid_, "hx");
  absl::StatusOr<std::string> added = RunChecked({"ip", "netns", "add", probe_ns});
  if (!added.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("`ip netns add` does not work here: ", added.status().message()));
  }
  absl::StatusOr<std::string> veth =
      RunChecked({"ip", "link", "add", probe_if, "type", "veth", "peer", "name",
                  absl::StrCat("tdm", cluster->pid_, "vx"), "netns", probe_ns});
  (void)RunCommand({"ip", "link", "del", probe_if});
  (void)RunCommand({"ip", "netns", "del", probe_ns});
  if (!veth.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create a veth pair: ", veth.status().message()));
  }
  TANDEM_RETURN_IF_ERROR(cluster->Claim());
  char dir[64];
  std::snprintf(dir, sizeof(dir), "/tmp/tdm%d-XXXXXX", static_cast<int>(cluster->pid_));
  if (mkdtemp(dir) == nullptr) return absl::InternalError("mkdtemp failed");
  cluster->log_dir_ = dir;
  return cluster;
}

absl::Status NetnsCluster::Claim() {
  const std::vector<std::pair<uint32_t, int>> used = UsedPrefixes();
  for (uint32_t k = 0; k < kBlocks; ++k) {
    const uint32_t block = (static_cast<uint32_t>(pid_) + k) % kBlocks;
    const uint32_t base = kRangeBase + block * kBlockAddresses;
    bool taken = false;
    for (const auto& prefix : used) taken = taken || Overlaps(prefix, {base, 25});
    if (taken) continue;
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::InternalError("socket(AF_UNIX) failed");
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    // Abstract name (leading NUL): no file, released when this process exits.
    const std::string name = absl::StrCat("tandem-netns-cluster-198.18-block-", block);
    std::memcpy(address.sun_path + 1, name.data(), name.size());
    const socklen_t length =
        static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    if (bind(fd, reinterpret_cast<sockaddr*>(&address), length) == 0) {
      claim_fd_ = fd;
      block_base_ = base;
      return absl::OkStatus();
    }
    close(fd);
  }
  return absl::ResourceExhaustedError(
      "every /25 block of 198.18.0.0/15 is held by another cluster or used on this machine");
}

NetnsCluster::~NetnsCluster() {
  // Stop every process at once, then give them stop_timeout together.
  for (auto& node : nodes_) {
    for (Subprocess* p : {node->process.get(), node->proxy.get()}) {
      if (p != nullptr) p->Signal(SIGTERM);
    }
  }
  const Clock::time_point deadline = Clock::now() + options_.stop_timeout;
  for (auto& node : nodes_) {
    for (Subprocess* p : {node->process.get(), node->proxy.get()}) {
      if (p == nullptr) continue;
      const auto left = std::max(Clock::duration::zero(), deadline - Clock::now());
      (void)p->WaitExit(std::chrono::duration_cast<std::chrono::milliseconds>(left));
    }
  }
  for (auto& node : nodes_) DestroyNode(node.get());  // SIGKILLs what is still running
  if (!log_dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(log_dir_, ignored);
  }
  if (claim_fd_ >= 0) close(claim_fd_);
  g_cluster_alive = false;
}

void NetnsCluster::DestroyNode(Node* node) {
  node->proxy.reset();  // SIGKILL + reap if still running
  node->process.reset();
  if (node->link_created) {
    // Deleting one end deletes the pair; done explicitly because a namespace's own cleanup (and
    // with it its veth end) runs asynchronously after `ip netns del`.
    absl::StatusOr<CommandResult> r = RunCommand({"ip", "link", "del", node->host_if});
    if (!r.ok() || r->exit_code != 0) {
      std::fprintf(stderr, "NetnsCluster: cannot delete link %s\n", node->host_if.c_str());
    }
    node->link_created = false;
  }
  if (node->ns_created) {
    absl::StatusOr<CommandResult> r = RunCommand({"ip", "netns", "del", node->ns});
    if (!r.ok() || r->exit_code != 0) {
      std::fprintf(stderr, "NetnsCluster: cannot delete namespace %s\n", node->ns.c_str());
    }
    node->ns_created = false;
  }
}

absl::StatusOr<size_t> NetnsCluster::AddNode(const NodeSpec& spec) {
  if (spec.latency_ms < 0 || spec.latency_ms > 10000) {
    return absl::InvalidArgumentError(
        absl::StrCat("latency_ms must be in [0, 10000], got ", spec.latency_ms));
  }
  if (spec.threads == 0 || spec.executor_threads == 0 || spec.pool_bytes == 0) {
    return absl::InvalidArgumentError("threads, executor_threads and pool_bytes must be > 0");
  }
  const size_t i = nodes_.size();
  if (i >= kMaxNodes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a cluster holds at most ", kMaxNodes, " nodes"));
  }
  auto node = std::make_unique<Node>();
  node->ns = absl::StrCat("tdm", pid_, "n", i);
  node->host_if = absl::StrCat("tdm", pid_, "h", i);
  node->ns_if = absl::StrCat("tdm", pid_, "v", i);
  node->host_ip = Ipv4(block_base_ + 4 * static_cast<uint32_t>(i) + 1);
  node->ns_ip = Ipv4(block_base_ + 4 * static_cast<uint32_t>(i) + 2);
  const absl::Status started = StartNode(spec, node.get());
  if (!started.ok()) {
    DestroyNode(node.get());
    return started;
  }
  nodes_.push_back(std::move(node));
  return i;
}

absl::Status NetnsCluster::StartNode(const NodeSpec& spec, Node* node) {
  TANDEM_RETURN_IF_ERROR(RunChecked({"ip", "netns", "add", node->ns}).status());
  node->ns_created = true;
  // The peer is created directly inside the namespace: its name never exists in the root one.
  TANDEM_RETURN_IF_ERROR(RunChecked({"ip", "link", "add", node->host_if, "type", "veth", "peer",
                                     "name", node->ns_if, "netns", node->ns})
                             .status());
  node->link_created = true;
  TANDEM_RETURN_IF_ERROR(
      RunChecked({"ip", "addr", "add", node->host_ip + "/30", "dev", node->host_if}).status());
  TANDEM_RETURN_IF_ERROR(RunChecked({"ip", "link", "set", node->host_if, "up"}).status());
  TANDEM_RETURN_IF_ERROR(
      RunChecked({"ip", "-n", node->ns, "addr", "add", node->ns_ip + "/30", "dev", node->ns_if})
          .status());
  TANDEM_RETURN_IF_ERROR(
      RunChecked({"ip", "-n", node->ns, "link", "set", node->ns_if, "up"}).status());
  TANDEM_RETURN_IF_ERROR(RunChecked({"ip", "-n", node->ns, "link", "set", "lo", "up"}).status());
  TANDEM_ASSIGN_OR_RETURN(node->latency, AddLatency(spec, *node));

  const bool proxied = node->latency == LatencyMechanism::kProxy;
  std::vector<std::string> argv = {
      "ip",
      "netns",
      "exec",
      node->ns,
      options_.node_binary,
      absl::StrCat("--address=", proxied ? "127.0.0.1" : node->ns_ip, ":0"),
      absl::StrCat("--pool_bytes=", spec.pool_bytes),
      absl::StrCat("--threads=", spec.threads),
      absl::StrCat("--executor_threads=", spec.executor_threads),
      "--log_level=warn"};
  argv.insert(argv.end(), spec.extra_flags.begin(), spec.extra_flags.end());
  TANDEM_ASSIGN_OR_RETURN(node->process,
                          Subprocess::Start(argv, absl::StrCat(log_dir_, "/", node->ns, ".log")));
  absl::StatusOr<int> port = node->process->WaitListening(options_.start_timeout);
  if (!port.ok()) {
    return absl::UnavailableError(absl::StrCat("node ", node->ns, ": ", port.status().message()));
  }
  if (proxied) {
    TANDEM_ASSIGN_OR_RETURN(
        node->proxy,
        Subprocess::Start({"ip", "netns", "exec", node->ns, options_.proxy_binary,
                           absl::StrCat("--listen=", node->ns_ip, ":0"),
                           absl::StrCat("--target=127.0.0.1:", *port),
                           absl::StrCat("--delay_us=", int64_t{spec.latency_ms} * 500)},
                          absl::StrCat(log_dir_, "/", node->ns, "-proxy.log")));
    port = node->proxy->WaitListening(options_.start_timeout);
    if (!port.ok()) {
      return absl::UnavailableError(
          absl::StrCat("delay proxy of ", node->ns, ": ", port.status().message()));
    }
  }
  TANDEM_RETURN_IF_ERROR(WaitConnectable(node->ns_ip, *port, options_.start_timeout));
  node->address = absl::StrCat(node->ns_ip, ":", *port);
  return absl::OkStatus();
}

absl::StatusOr<LatencyMechanism> NetnsCluster::AddLatency(const NodeSpec& spec, const Node& node) {
  if (spec.latency_ms == 0) return LatencyMechanism::kNone;
  if (options_.latency == LatencyPreference::kProxy) return LatencyMechanism::kProxy;
  if (netem_ != 0) {
    // Half the round trip on each veth end's egress.
    const std::string delay = absl::StrCat(int64_t{spec.latency_ms} * 500, "us");
    absl::StatusOr<std::string> inside = RunChecked(
        {"tc", "-n", node.ns, "qdisc", "add", "dev", node.ns_if, "root", "netem", "delay", delay});
    absl::StatusOr<std::string> outside =
        inside.ok() ? RunChecked({"tc", "qdisc", "add", "dev", node.host_if, "root", "netem",
                                  "delay", delay})
                    : inside;
    if (outside.ok()) {
      netem_ = 1;
      return LatencyMechanism::kNetem;
    }
    if (inside.ok()) {
      (void)RunCommand({"tc", "-n", node.ns, "qdisc", "del", "dev", node.ns_if, "root"});
    }
    if (netem_ == 1) return outside.status();  // worked before: a real failure
    netem_ = 0;
    netem_error_ = std::string(absl::StripAsciiWhitespace(outside.status().message()));
  }
  if (options_.latency == LatencyPreference::kNetem) {
    return absl::FailedPreconditionError(absl::StrCat("netem is unavailable: ", netem_error_));
  }
  return LatencyMechanism::kProxy;
}

const std::string& NetnsCluster::address(size_t i) const { return nodes_.at(i)->address; }

std::vector<std::string> NetnsCluster::addresses() const {
  std::vector<std::string> out;
  for (const auto& node : nodes_) out.push_back(node->address);
  return out;
}

LatencyMechanism NetnsCluster::latency_mechanism(size_t i) const { return nodes_.at(i)->latency; }
const std::string& NetnsCluster::netns(size_t i) const { return nodes_.at(i)->ns; }
const std::string& NetnsCluster::host_ip(size_t i) const { return nodes_.at(i)->host_ip; }
pid_t NetnsCluster::pid(size_t i) const { return nodes_.at(i)->process->pid(); }
std::string NetnsCluster::log(size_t i) const { return nodes_.at(i)->process->log(); }

void NetnsCluster::Drain(size_t i) { nodes_.at(i)->process->Signal(SIGTERM); }
void NetnsCluster::Kill(size_t i) { nodes_.at(i)->process->Signal(SIGKILL); }

absl::StatusOr<int> NetnsCluster::WaitExit(size_t i, std::chrono::milliseconds timeout) {
  return nodes_.at(i)->process->WaitExit(timeout);
}

bool NetnsCluster::running(size_t i) { return nodes_.at(i)->process->running(); }

}  // namespace tandem::multihost
