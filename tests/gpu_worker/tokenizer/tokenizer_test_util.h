// A temporary model directory for tokenizer tests, removed when the object goes away.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>

namespace tandem::gpu_worker {

class TempModelDir {
 public:
  TempModelDir() {
    static std::atomic<int> counter{0};
    path_ =
        std::filesystem::temp_directory_path() /
        ("tandem_tokenizer_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempModelDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempModelDir(const TempModelDir&) = delete;
  TempModelDir& operator=(const TempModelDir&) = delete;

  void Write(const std::string& name, const std::string& contents) const {
    std::ofstream file(path_ / name, std::ios::binary);
    file << contents;
    ASSERT_TRUE(file.good()) << name;
  }

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace tandem::gpu_worker
