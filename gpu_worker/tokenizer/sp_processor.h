// A thin wrapper over libsentencepiece, reached through the dlopen'ed module
// libtandem_sentencepiece.so (sp_shim.cc explains why it cannot be linked directly).
//
// Thread safety: as sentencepiece::SentencePieceProcessor, const methods may be called
// concurrently after Load.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::gpu_worker::tokenizer_internal {

class SpProcessor {
 public:
  SpProcessor();
  ~SpProcessor();
  SpProcessor(const SpProcessor&) = delete;
  SpProcessor& operator=(const SpProcessor&) = delete;

  // Loads a serialized ModelProto (a tokenizer.model file's bytes). Returns "" on success, else
  // the library's error message (or why the module could not be loaded).
  std::string LoadFromSerializedProto(std::string_view serialized);

  // Ids of `text` (no BOS/EOS). Returns "" on success, else the library's error message.
  std::string Encode(std::string_view text, std::vector<int>* ids) const;

  // The library's own decoding, for tests.
  std::string DecodeIds(const std::vector<int>& ids) const;

  int GetPieceSize() const;
  std::string IdToPiece(int id) const;  // id in [0, GetPieceSize())
  bool IsByte(int id) const;
  bool IsControl(int id) const;
  bool IsUnknown(int id) const;
  int bos_id() const;  // -1 if none
  int eos_id() const;  // -1 if none

 private:
  void* impl_ = nullptr;  // the module's processor; nullptr when the module is unavailable
};

}  // namespace tandem::gpu_worker::tokenizer_internal
