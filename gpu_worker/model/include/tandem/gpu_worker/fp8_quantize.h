// FP8 (e4m3) quantization of a float weight matrix with one scale per output row: what
// `--quantization fp8` does to a bf16/f16/f32 checkpoint's projections at load (vLLM's
// `--quantization fp8` makes the same per-channel FP8 weights), giving exactly the codes and
// scales an FP8 checkpoint of that layout holds (model_weights.h).
//
// Thread safety: reentrant. Large matrices are split by rows over up to hardware_concurrency()
// threads (at most 16), joined before the call returns.
#pragma once

#include "absl/status/status.h"
#include "tandem/common/f8e4m3.h"
#include "tandem/gpu_worker/safetensors.h"

namespace tandem::gpu_worker {

// w: [rows, cols] of f32, bf16 or f16 (nn.Linear's [out_features, in_features]);
// codes: [rows, cols] e4m3, written; scales: [rows] f32, written.
//
// Row r: scales[r] = max_c |w[r, c]| / 448 (f32 division) and codes[r, c] =
// FloatToF8E4M3(w[r, c] / scales[r]): round to nearest even, saturating at ±448. So the largest
// magnitude of each row gets the code ±448 (0x7e / 0xfe) and every code·scales[r] is within half
// an e4m3 ulp (2^-4 relative; 2^-10·scales[r] among the subnormal codes) of w[r, c].
// A row whose max |w| / 448 is 0 (all zeros, or magnitudes so small the quotient underflows) gets
// scale 1 and codes ±0: a positive, finite scale divides nothing by zero and dequantizes the row
// to exactly 0 (the cuda backend's per-row activation quantizer takes 1 for zero rows too).
//
// Errors: INVALID_ARGUMENT naming the tensor when it is not a 2-D f32/bf16/f16 matrix, or when an
// element is NaN or infinite (its row and column given: such a weight has no FP8 value and would
// make its row's scale meaningless). codes and scales are then unspecified.
absl::Status QuantizeFp8PerRow(const TensorView& w, f8e4m3_t* codes, float* scales);

}  // namespace tandem::gpu_worker
