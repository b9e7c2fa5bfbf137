// SpProcessor over libtandem_sentencepiece.so (sp_shim.cc), loaded once per process with
// dlopen(RTLD_LOCAL | RTLD_DEEPBIND): see sp_shim.cc for why libsentencepiece must not be linked
// into the process directly.
//
// The module is looked up, in order: $TANDEM_SENTENCEPIECE_SHIM; next to the executable and in
// ../lib from it; the build tree's copy (TANDEM_SPM_SHIM_BUILD_PATH); the dynamic loader's
// search path (LD_LIBRARY_PATH, as the GPU-host bundle sets it).
#include "sp_processor.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>

// RTLD_DEEPBIND keeps the module's protobuf-lite to itself (sp_shim.cc). AddressSanitizer cannot
// run a deep-bound library (it would bypass the sanitizer's malloc; google/sanitizers#611), so
// the sanitizer build loads it without; whether libsentencepiece then still works is what the
// tokenizer tests of scripts/sanitize.sh check.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TANDEM_SP_NO_DEEPBIND 1
#endif
#endif
#ifdef TANDEM_SP_NO_DEEPBIND
constexpr int kDlopenFlags = RTLD_NOW | RTLD_LOCAL;
#else
constexpr int kDlopenFlags = RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND;
#endif

namespace tandem::gpu_worker::tokenizer_internal {
namespace {

struct ShimApi {
  void* (*create)() = nullptr;
  void (*destroy)(void*) = nullptr;
  void (*free)(void*) = nullptr;
  char* (*load)(void*, const char*, size_t) = nullptr;
  char* (*encode)(void*, const char*, size_t, int**, size_t*) = nullptr;
  char* (*decode)(void*, const int*, size_t) = nullptr;
  char* (*id_to_piece)(void*, int) = nullptr;
  int (*query)(void*, int, int) = nullptr;
  std::string error;  // why loading failed; empty when the API is usable
};

std::string ExecutableDir() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : exe.parent_path().string();
}

const ShimApi& Api() {
  static ShimApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    constexpr const char* kName = "libtandem_sentencepiece.so";
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("TANDEM_SENTENCEPIECE_SHIM")) candidates.push_back(env);
    const std::string dir = ExecutableDir();
    if (!dir.empty()) {
      candidates.push_back(dir + "/" + kName);
      candidates.push_back(dir + "/../lib/" + kName);
    }
#ifdef TANDEM_SPM_SHIM_BUILD_PATH
    candidates.push_back(TANDEM_SPM_SHIM_BUILD_PATH);
#endif
    candidates.push_back(kName);
    void* handle = nullptr;
    std::string tried;
    for (const std::string& path : candidates) {
      if (path.find('/') != std::string::npos && !std::filesystem::exists(path)) continue;
      handle = dlopen(path.c_str(), kDlopenFlags);
      if (handle != nullptr) break;
      const char* e = dlerror();
      tried += "\n  " + path + ": " + (e ? e : "?");
    }
    if (handle == nullptr) {
      api.error = std::string("cannot load ") + kName + " (SentencePiece support)" + tried;
      return;
    }
    auto sym = [&](const char* name) { return dlsym(handle, name); };
    api.create = reinterpret_cast<void* (*)()>(sym("tandem_spm_create"));
    api.destroy = reinterpret_cast<void (*)(void*)>(sym("tandem_spm_destroy"));
    api.free = reinterpret_cast<void (*)(void*)>(sym("tandem_spm_free"));
    api.load = reinterpret_cast<char* (*)(void*, const char*, size_t)>(sym("tandem_spm_load"));
    api.encode = reinterpret_cast<char* (*)(void*, const char*, size_t, int**, size_t*)>(
        sym("tandem_spm_encode"));
    api.decode = reinterpret_cast<char* (*)(void*, const int*, size_t)>(sym("tandem_spm_decode"));
    api.id_to_piece = reinterpret_cast<char* (*)(void*, int)>(sym("tandem_spm_id_to_piece"));
    api.query = reinterpret_cast<int (*)(void*, int, int)>(sym("tandem_spm_query"));
    if (!api.create || !api.destroy || !api.free || !api.load || !api.encode || !api.decode ||
        !api.id_to_piece || !api.query) {
      api.error = std::string(kName) + " lacks a tandem_spm_* function";
    }
    // The handle stays open for the life of the process.
  });
  return api;
}

// Takes ownership of a malloc'ed string from the shim.
std::string Take(char* s) {
  if (s == nullptr) return std::string();
  std::string out(s);
  Api().free(s);
  return out;
}

}  // namespace

SpProcessor::SpProcessor() {
  if (Api().error.empty()) impl_ = Api().create();
}

SpProcessor::~SpProcessor() {
  if (impl_ != nullptr) Api().destroy(impl_);
}

std::string SpProcessor::LoadFromSerializedProto(std::string_view serialized) {
  if (!Api().error.empty()) return Api().error;
  if (impl_ == nullptr) return "cannot create a SentencePiece processor";
  char* error = Api().load(impl_, serialized.data(), serialized.size());
  return error == nullptr ? std::string() : Take(error);
}

std::string SpProcessor::Encode(std::string_view text, std::vector<int>* ids) const {
  if (impl_ == nullptr) return "no SentencePiece model loaded";
  int* raw = nullptr;
  size_t count = 0;
  char* error = Api().encode(impl_, text.data(), text.size(), &raw, &count);
  if (error != nullptr) return Take(error);
  ids->assign(raw, raw + count);
  Api().free(raw);
  return std::string();
}

std::string SpProcessor::DecodeIds(const std::vector<int>& ids) const {
  if (impl_ == nullptr) return std::string();
  return Take(Api().decode(impl_, ids.data(), ids.size()));
}

int SpProcessor::GetPieceSize() const { return impl_ ? Api().query(impl_, 0, 0) : 0; }
std::string SpProcessor::IdToPiece(int id) const {
  return impl_ ? Take(Api().id_to_piece(impl_, id)) : std::string();
}
bool SpProcessor::IsByte(int id) const { return impl_ && Api().query(impl_, 3, id) == 1; }
bool SpProcessor::IsControl(int id) const { return impl_ && Api().query(impl_, 4, id) == 1; }
bool SpProcessor::IsUnknown(int id) const { return impl_ && Api().query(impl_, 5, id) == 1; }
int SpProcessor::bos_id() const { return impl_ ? Api().query(impl_, 1, 0) : -1; }
int SpProcessor::eos_id() const { return impl_ ? Api().query(impl_, 2, 0) : -1; }

}  // namespace tandem::gpu_worker::tokenizer_internal
