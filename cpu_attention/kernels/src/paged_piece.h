// One piece of a paged-attention call: entries [skip, skip + count) of a problem's runs for its
// query rows, scanned with an online softmax into one (O, LSE) state (paged_attention.cc plans
// the pieces and runs them on the pool; paged_piece.cc is the scan).
#pragma once

#include <cstddef>
#include <cstdint>

#include "tandem/cpu_attention/paged_attention.h"
#include "tandem/cpu_isa/cpu_isa.h"
#include "tandem/kv_store/block_format.h"

namespace tandem::cpu_attention::internal {

struct RowScanKernels;

// A read position in a piece's runs: entry `offset` of *run, `left` entries to go.
struct RunCursor {
  const KvRun* run;
  uint64_t offset;
  uint64_t left;
};

// Where a piece writes: row r = t * G + j at o + t * o_stride + j * D, lse + t * lse_stride + j.
struct RowsOut {
  float* o;
  size_t o_stride;
  float* lse;
  size_t lse_stride;
};

// Where the piece after this one reads: fn(ctx), called at most once per piece.
struct NextPiece {
  RunCursor (*fn)(void* ctx) = nullptr;
  void* ctx = nullptr;
};

// One piece: entries [skip, skip + count) of the runs starting at `runs`, for R = T * G query
// rows. `work` holds [R, D] scaled queries, [R, D] accumulators, m [R], l [R] and the scores
// [R, kChunk].
struct PieceArgs {
  uint64_t prefetch_entries;  // PagedParams::prefetch_entries
  const KvRun* runs;
  uint64_t skip;
  uint64_t count;
  // Entries at the piece's start that the piece before it already prefetched (its next piece).
  uint64_t prefetched = 0;
  // The piece its thread runs next, asked for once this piece's own rows are all prefetched
  // (null fn: none): the prefetch stream goes on into its entries (an empty cursor: none), so
  // it starts warm. Asked that late, a caller that claims work for it commits only one prefetch
  // distance ahead.
  NextPiece next{};
  // Out: the entries of the next piece this piece prefetched (the next piece's `prefetched`).
  uint64_t* next_prefetched = nullptr;
  const float* q;
  size_t q_stride;
  uint32_t T, G, D;
  float scale;
  RowsOut out;
  float* work;
  // int8 and bf16: the register-widening kernels of row_scan_kernels.h (nullptr: the portable
  // path: f32 tiles for int8, GCC vector types for bf16)
  const internal::RowScanKernels* row_kernels = nullptr;
};

// The floats of a piece's `work` for `rows` query rows of D elements (int8 pieces also widen
// a chunk's K and V codes into f32 tiles).
size_t WorkFloats(size_t rows, size_t D, bool int8);

// The scan for rows of `dtype` on instruction set `isa`.
using PieceKernel = void (*)(const PieceArgs&);
PieceKernel PieceKernelFor(kv_store::KvDType dtype, CpuIsa isa);

}  // namespace tandem::cpu_attention::internal
