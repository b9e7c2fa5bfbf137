// The messages of a session's shared-memory channel (shm_channel.h) between the GPU worker and a
// CPU attention node: Attend and AppendKv of the one session the channel was opened for, with
// the same semantics as the gRPC calls of proto/tandem/v1/cpu_attention.proto. Control calls
// (OpenSession, Reselect, CloseSession, Stats) stay on gRPC.
//
// Every message starts with a 64-byte header; arrays follow at 64-byte aligned offsets computed
// by the layout functions below, which both sides use. A reader bounds every count it reads by
// the message size before using it (the layout functions return nullopt on overflow).
//
// Request (client -> node):
//   kAttend: q f32 [num_tokens, H_q, D] at kPayloadOffset, then (pages sessions, when
//            pages_per_head > 0) pages int32 [num_tokens, H_kv, pages_per_head] as in
//            AttendQuery.pages (AttendRequestLayout, both sides)
//   kAppend: kv_heads u32 [num_heads], k [num_heads, num_tokens, D] of the session's kv dtype,
//            v (same), maw f32 [num_heads, num_tokens]  (AppendLayout, from payload_offset)
// Response (node -> client): a ResponseHeader; on error (code != 0) `message_bytes` of text at
// kPayloadOffset; for kAttend the arrays of AttendLayout (num_heads = H_own, the owned kv heads
// of the layer; rows of o and lse are ordered as in AttendResult: row h*G+j is query head
// kv_heads[h]*G + j).
#pragma once

#include <cstdint>
#include <optional>

namespace tandem::cpu_attention::shm {

enum class Kind : uint32_t { kAttend = 1, kAppend = 2 };

constexpr uint64_t kPayloadOffset = 64;

struct RequestHeader {
  uint32_t kind;  // Kind
  uint32_t layer;
  uint32_t num_tokens;      // kAttend: query tokens T; kAppend: entries per head n
  uint32_t num_heads;       // kAppend: kv heads listed
  uint32_t window_entries;  // kAppend: n_gpu of the β / n_gpu threshold
  // kAppend: where the arrays start in the message (64-aligned, >= kPayloadOffset; 0 means
  // kPayloadOffset). The client alternates two halves of the request area so it can fill the
  // next chunk while the node copies this one.
  uint32_t payload_offset;
  // kAttend: page ids per (token, kv head) after q (AttendQuery.pages_per_head); 0 = none
  // (MAW sessions; dense over every held entry in pages sessions).
  uint32_t pages_per_head;
  uint32_t reserved[9];
};
static_assert(sizeof(RequestHeader) == kPayloadOffset);

struct ResponseHeader {
  uint32_t code;              // absl::StatusCode; 0 = OK
  uint32_t message_bytes;     // error text after the header
  uint32_t num_heads;         // kAttend: H_own
  uint32_t num_tokens;        // kAttend: T
  uint32_t group;             // kAttend: G = H_q / H_kv
  uint32_t head_dim;          // kAttend: D
  uint64_t compute_micros;    // kAttend
  uint64_t bytes_scanned;     // kAttend
  uint64_t entries_appended;  // kAppend
  uint64_t entries_selected;  // kAppend
  // kAttend: the node's time serving the request, from reading it to its answer written
  // (checks, planning, compute_micros, laying out the answer); the rest of the client's round
  // trip is the channel's.
  uint64_t handle_micros;
};
static_assert(sizeof(ResponseHeader) == kPayloadOffset);

inline uint64_t Align64(uint64_t x) { return (x + 63) & ~uint64_t{63}; }

// a * b, or nullopt past 2^48 (far beyond any area).
inline std::optional<uint64_t> Mul(uint64_t a, uint64_t b) {
  constexpr uint64_t kLimit = uint64_t{1} << 48;
  if (a != 0 && b > kLimit / a) return std::nullopt;
  return a * b;
}

// Byte offsets of an append request's arrays; `end` is the message size.
struct AppendLayout {
  uint64_t heads = 0, k = 0, v = 0, maw = 0, end = 0;
  uint64_t kv_bytes = 0;  // bytes of k (and of v)
  uint64_t maw_bytes = 0;
};

inline std::optional<AppendLayout> AppendLayoutFor(uint64_t num_heads, uint64_t num_tokens,
                                                   uint64_t row_bytes,
                                                   uint64_t base = kPayloadOffset) {
  const auto entries = Mul(num_heads, num_tokens);
  if (!entries) return std::nullopt;
  const auto kv = Mul(*entries, row_bytes);
  const auto maw = Mul(*entries, sizeof(float));
  const auto heads = Mul(num_heads, sizeof(uint32_t));
  if (!kv || !maw || !heads) return std::nullopt;
  AppendLayout l;
  l.kv_bytes = *kv;
  l.maw_bytes = *maw;
  if (base < kPayloadOffset || base % 64 != 0 || base > (uint64_t{1} << 40)) return std::nullopt;
  l.heads = base;
  l.k = Align64(l.heads + *heads);
  l.v = Align64(l.k + *kv);
  l.maw = Align64(l.v + *kv);
  l.end = l.maw + *maw;
  return l;
}

// Byte offsets of an attend response's arrays; `end` is the message size.
struct AttendLayout {
  uint64_t kv_heads = 0, selected = 0, held = 0, o = 0, lse = 0, end = 0;
  uint64_t rows = 0;  // T * H_own * G: rows of o, elements of lse
};

inline std::optional<AttendLayout> AttendLayoutFor(uint64_t num_heads, uint64_t num_tokens,
                                                   uint64_t group, uint64_t head_dim) {
  const auto per_token = Mul(num_heads, group);
  if (!per_token) return std::nullopt;
  const auto rows = Mul(*per_token, num_tokens);
  if (!rows) return std::nullopt;
  const auto o_elems = Mul(*rows, head_dim);
  if (!o_elems || *o_elems > (uint64_t{1} << 44)) return std::nullopt;
  AttendLayout l;
  l.rows = *rows;
  l.kv_heads = kPayloadOffset;
  l.selected = Align64(l.kv_heads + num_heads * sizeof(uint32_t));
  l.held = Align64(l.selected + num_heads * sizeof(uint64_t));
  l.o = Align64(l.held + num_heads * sizeof(uint64_t));
  l.lse = Align64(l.o + *o_elems * sizeof(float));
  l.end = l.lse + *rows * sizeof(float);
  return l;
}

// Byte offsets of an attend request's arrays; `end` is the message size. pages_per_head 0: no
// pages array (pages == end == the end of q).
struct AttendRequestLayout {
  uint64_t q = 0, pages = 0, end = 0;
  uint64_t q_floats = 0;  // T * H_q * D
  uint64_t page_ids = 0;  // T * H_kv * pages_per_head
};

inline std::optional<AttendRequestLayout> AttendRequestLayoutFor(uint64_t num_tokens,
                                                                 uint64_t num_q_heads,
                                                                 uint64_t head_dim,
                                                                 uint64_t num_kv_heads,
                                                                 uint64_t pages_per_head) {
  const auto a = Mul(num_tokens, num_q_heads);
  if (!a) return std::nullopt;
  const auto q_floats = Mul(*a, head_dim);
  if (!q_floats) return std::nullopt;
  const auto b = Mul(num_tokens, num_kv_heads);
  if (!b) return std::nullopt;
  const auto ids = Mul(*b, pages_per_head);
  if (!ids || *q_floats > (uint64_t{1} << 44) || *ids > (uint64_t{1} << 44)) return std::nullopt;
  AttendRequestLayout l;
  l.q_floats = *q_floats;
  l.page_ids = *ids;
  l.q = kPayloadOffset;
  const uint64_t q_end = l.q + *q_floats * sizeof(float);
  l.pages = *ids == 0 ? q_end : Align64(q_end);
  l.end = l.pages + *ids * sizeof(int32_t);
  return l;
}

// Size of an attend request of T tokens without pages.
inline std::optional<uint64_t> AttendRequestBytes(uint64_t num_tokens, uint64_t num_q_heads,
                                                  uint64_t head_dim) {
  const auto l = AttendRequestLayoutFor(num_tokens, num_q_heads, head_dim, 1, 0);
  if (!l) return std::nullopt;
  return l->end;
}

}  // namespace tandem::cpu_attention::shm
