// Shared by the geometry tests: the backend under test (the same sources build a cpu-backend
// binary and, with TANDEM_TEST_BACKEND_CUDA, a cuda one labelled gpu) and a temporary directory.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <memory>
#include <string>
#include <system_error>

#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker::testing {

inline const char* TestBackendName() {
#ifdef TANDEM_TEST_BACKEND_CUDA
  return "cuda";
#else
  return "cpu";
#endif
}

// The backend under test, or nullptr with the reason in *why (the caller skips).
inline std::unique_ptr<Backend> MakeTestBackend(std::string* why) {
#ifdef TANDEM_TEST_BACKEND_CUDA
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateCudaBackend(0);
#else
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateCpuBackend(0);
#endif
  if (!backend.ok()) {
    *why = std::string(backend.status().message());
    return nullptr;
  }
  return std::move(*backend);
}

// A fresh directory under the system temp dir, removed with its contents on destruction.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "tandem_geo_XXXXXX").string();
    if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace tandem::gpu_worker::testing

#define TANDEM_GEO_BACKEND_OR_SKIP(var)                                       \
  std::string var##_why;                                                      \
  std::unique_ptr<::tandem::gpu_worker::Backend> var =                        \
      ::tandem::gpu_worker::testing::MakeTestBackend(&var##_why);             \
  if (var == nullptr) {                                                       \
    GTEST_SKIP() << "no " << ::tandem::gpu_worker::testing::TestBackendName() \
                 << " backend: " << var##_why;                                \
  }
