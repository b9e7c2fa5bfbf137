// grpc.health.v1.Health/Check from tests, through a generic stub (tandem does not build the
// health proto's client): request {service}, response {status}.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::test_health {

inline constexpr int kServing = 1;
inline constexpr int kNotServing = 2;

// The serialized HealthCheckResponse ("\x08\x01" is SERVING; "" is the default, UNKNOWN), or
// UNAVAILABLE with the RPC's error. Deadline: 10 s.
inline absl::StatusOr<std::string> HealthCheckBytes(const std::shared_ptr<grpc::Channel>& channel,
                                                    const std::string& service) {
  grpc::GenericStub generic(channel);
  std::string request;
  if (!service.empty()) {
    request.push_back(0x0a);  // field 1, length-delimited
    request.push_back(static_cast<char>(service.size()));
    request += service;
  }
  grpc::Slice slice(request);
  grpc::ByteBuffer send(&slice, 1), recv;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &send, &recv,
                    [&](grpc::Status s) {
                      std::lock_guard lock(mu);
                      status = s;
                      done = true;
                      cv.notify_one();
                    });
  std::unique_lock lock(mu);
  cv.wait(lock, [&] { return done; });
  if (!status.ok()) return absl::UnavailableError(status.error_message());
  std::vector<grpc::Slice> slices;
  if (!recv.Dump(&slices).ok()) return absl::InternalError("cannot read the answer");
  std::string bytes;
  for (auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes;
}

// The status enum (kServing, kNotServing, 0 for UNKNOWN), or the call's error.
inline absl::StatusOr<int> HealthStatus(const std::shared_ptr<grpc::Channel>& channel,
                                        const std::string& service) {
  absl::StatusOr<std::string> bytes = HealthCheckBytes(channel, service);
  if (!bytes.ok()) return bytes.status();
  if (bytes->empty()) return 0;  // UNKNOWN (default value, not serialised)
  if (bytes->size() != 2 || (*bytes)[0] != 0x08) return absl::InternalError("unexpected answer");
  return static_cast<int>((*bytes)[1]);
}

}  // namespace tandem::test_health
