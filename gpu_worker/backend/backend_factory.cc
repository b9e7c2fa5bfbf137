// The one place that knows whether the CUDA backend was compiled in.
#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker {

#ifdef TANDEM_HAVE_CUDA
bool CudaBackendCompiled() { return true; }
#else
bool CudaBackendCompiled() { return false; }

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int /*device_ordinal*/,
                                                           const BackendOptions& /*options*/) {
  return absl::UnavailableError(
      "this tandem build has no CUDA backend (configure with TANDEM_ENABLE_CUDA=ON where nvcc "
      "exists)");
}
#endif

}  // namespace tandem::gpu_worker
