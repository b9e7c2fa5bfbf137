// Shared by the engine tests: where the real models are, which backend the test binary runs
// (the same sources build a cpu-backend binary and, with TANDEM_TEST_BACKEND_CUDA, a cuda one
// labelled gpu), and how to skip when either is missing.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker::testing {

// $TANDEM_SHARED_DIR when set (the GPU host carries the models elsewhere), else the shared
// folder beside the checkout this binary was built from.
inline std::filesystem::path SharedDir() {
  if (const char* env = std::getenv("TANDEM_SHARED_DIR"); env != nullptr && *env != '\0') {
    return env;
  }
  return TANDEM_SHARED_DIR;
}
inline std::filesystem::path ModelDir(const std::string& name) {
  return SharedDir() / "models" / name;
}

inline const char* TestBackendName() {
#ifdef TANDEM_TEST_BACKEND_CUDA
  return "cuda";
#else
  return "cpu";
#endif
}

// The backend under test, or nullptr with the reason in *why (the caller skips).
inline std::unique_ptr<Backend> MakeTestBackend(std::string* why) {
  absl::StatusOr<std::unique_ptr<Backend>> backend =
#ifdef TANDEM_TEST_BACKEND_CUDA
      CreateCudaBackend(0);
#else
      CreateCpuBackend(0);
#endif
  if (!backend.ok()) {
    *why = std::string(backend.status().message());
    return nullptr;
  }
  return std::move(*backend);
}

inline nlohmann::json ReadJson(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str());
}

inline std::string ReadText(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A prompt of `n` token ids from a small model's vocabulary: BOS (1), then ids in [3, 503) that
// `salt` varies.
inline std::vector<int32_t> SyntheticPrompt(int64_t n, int32_t salt) {
  std::vector<int32_t> ids{1};
  for (int64_t i = 1; i < n; ++i) ids.push_back(3 + static_cast<int32_t>((i * 37 + salt) % 500));
  return ids;
}

}  // namespace tandem::gpu_worker::testing

#define TANDEM_SKIP_WITHOUT_MODEL(name)                                                   \
  if (!std::filesystem::exists(::tandem::gpu_worker::testing::ModelDir(name) /          \
                               "config.json")) {                                         \
    GTEST_SKIP() << "model " << name << " not found under "                              \
                 << ::tandem::gpu_worker::testing::SharedDir() << "/models";             \
  }

// Skips when the shared data folder lacks `name` (a file or folder under data/).
#define TANDEM_SKIP_WITHOUT_DATA(name)                                                    \
  do {                                                                                    \
    if (!std::filesystem::exists(::tandem::gpu_worker::testing::SharedDir() / "data" /  \
                                 (name))) {                                              \
      GTEST_SKIP() << "data/" << (name) << " not found under "                           \
                   << ::tandem::gpu_worker::testing::SharedDir();                        \
    }                                                                                     \
  } while (0)

#define TANDEM_SKIP_WITHOUT_BACKEND()                                                     \
  do {                                                                                    \
    std::string why_;                                                                     \
    if (::tandem::gpu_worker::testing::MakeTestBackend(&why_) == nullptr) {               \
      GTEST_SKIP() << "no " << ::tandem::gpu_worker::testing::TestBackendName()           \
                   << " backend: " << why_;                                               \
    }                                                                                     \
  } while (0)
