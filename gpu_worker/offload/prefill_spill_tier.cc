#include "tandem/gpu_worker/prefill_spill_tier.h"

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {

TierFootprint PrefillSpillTier::footprint() const {
  TierFootprint f = inner_ != nullptr ? inner_->footprint() : TierFootprint{};
  f.host += spill_->footprint().host;
  return f;
}

absl::Status PrefillSpillTier::BeginPass(TierContext& context, size_t stream) {
  if (spill_->offloaded_tokens() != inner_->offloaded_tokens()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "prefill spill: the host copy holds ", spill_->offloaded_tokens(), " entries, the tier ",
        inner_->offloaded_tokens()));
  }
  return spill_->BeginPass(context, stream);
}

absl::Status PrefillSpillTier::Append(TierContext& context, WindowCache& window,
                                      const std::vector<EvictedBlock>& blocks) {
  TANDEM_RETURN_IF_ERROR(inner_->Append(context, window, blocks));
  return spill_->Append(context, window, blocks);
}

}  // namespace tandem::gpu_worker
