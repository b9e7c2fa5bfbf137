// libtandem_sentencepiece.so: a C interface over libsentencepiece, loaded with dlopen
// (RTLD_LOCAL | RTLD_DEEPBIND) by sp_processor.cc.
//
// Why a separately loaded module: Debian's libsentencepiece.so.0 carries its own copy of
// protobuf-lite and exports all of its symbols. Linked into a process that also uses the system
// libprotobuf (gRPC does), the two copies interpose on each other and the process crashes in
// protobuf's static initialisation before main(). Loaded locally with deep binding,
// sentencepiece resolves protobuf symbols to its own copy and nobody else sees them.
//
// Every function catches everything: no exception crosses the C boundary.
#include <sentencepiece_processor.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using Processor = sentencepiece::SentencePieceProcessor;

// Copies `s` into a malloc'ed NUL-terminated string (freed with tandem_spm_free).
char* Dup(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, s.data(), s.size());
    out[s.size()] = '\0';
  }
  return out;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* tandem_spm_create() {
  try {
    return new Processor();
  } catch (...) {
    return nullptr;
  }
}

__attribute__((visibility("default"))) void tandem_spm_destroy(void* p) {
  delete static_cast<Processor*>(p);
}

__attribute__((visibility("default"))) void tandem_spm_free(void* p) { std::free(p); }

// Returns nullptr on success, else a malloc'ed error message.
__attribute__((visibility("default"))) char* tandem_spm_load(void* p, const char* data,
                                                             size_t size) {
  try {
    const auto status =
        static_cast<Processor*>(p)->LoadFromSerializedProto(std::string(data, size));
    if (status.ok()) return nullptr;
    const std::string message = status.ToString();
    return Dup(message.empty() ? "unknown sentencepiece error" : message);
  } catch (...) {
    return Dup("sentencepiece threw while loading the model");
  }
}

// On success returns nullptr and sets *ids (malloc'ed) and *count; else an error message.
__attribute__((visibility("default"))) char* tandem_spm_encode(void* p, const char* text,
                                                               size_t size, int** ids,
                                                               size_t* count) {
  try {
    std::vector<int> out;
    const auto status = static_cast<Processor*>(p)->Encode(std::string(text, size), &out);
    if (!status.ok()) return Dup(status.ToString());
    *count = out.size();
    *ids = static_cast<int*>(std::malloc(std::max<size_t>(out.size(), 1) * sizeof(int)));
    if (*ids == nullptr) return Dup("out of memory");
    std::memcpy(*ids, out.data(), out.size() * sizeof(int));
    return nullptr;
  } catch (...) {
    return Dup("sentencepiece threw while encoding");
  }
}

// Returns a malloc'ed string (the decoded text or the piece), nullptr on failure.
__attribute__((visibility("default"))) char* tandem_spm_decode(void* p, const int* ids,
                                                               size_t count) {
  try {
    return Dup(static_cast<Processor*>(p)->DecodeIds(std::vector<int>(ids, ids + count)));
  } catch (...) {
    return nullptr;
  }
}

__attribute__((visibility("default"))) char* tandem_spm_id_to_piece(void* p, int id) {
  try {
    return Dup(static_cast<Processor*>(p)->IdToPiece(id));
  } catch (...) {
    return nullptr;
  }
}

// kind: 0 piece count, 1 bos id, 2 eos id; 3/4/5: is byte / control / unknown of `id`.
__attribute__((visibility("default"))) int tandem_spm_query(void* p, int kind, int id) {
  try {
    const Processor& sp = *static_cast<Processor*>(p);
    switch (kind) {
      case 0:
        return sp.GetPieceSize();
      case 1:
        return sp.bos_id();
      case 2:
        return sp.eos_id();
      case 3:
        return sp.IsByte(id) ? 1 : 0;
      case 4:
        return sp.IsControl(id) ? 1 : 0;
      case 5:
        return sp.IsUnknown(id) ? 1 : 0;
      default:
        return -1;
    }
  } catch (...) {
    return -1;
  }
}

}  // extern "C"
