#include "tandem/gpu_worker/tier_factory.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"
#include "tandem/gpu_worker/host_tier.h"
#include "tandem/gpu_worker/memory_shortage.h"
#include "tandem/gpu_worker/node_tier.h"
#include "tandem/gpu_worker/tier_traits.h"

namespace tandem::gpu_worker {
namespace {

absl::StatusOr<std::unique_ptr<OffloadTier>> OpenNodeTier(Backend& backend, NodePool& nodes,
                                                          const TierSpec& spec) {
  std::unique_ptr<PageIndex> pages;
  if (spec.node.selection == SelectionRule::kPages) {
    const int64_t page = spec.node.page_tokens;
    TANDEM_ASSIGN_OR_RETURN(PageIndex index, PageIndex::Create(backend, spec.geometry, page, 0,
                                                                    spec.low_rank));
    TANDEM_RETURN_IF_ERROR(index.Reserve((spec.summary_tokens + page - 1) / page));
    if (spec.seed_pages) TANDEM_RETURN_IF_ERROR(spec.seed_pages(index));
    pages = std::make_unique<PageIndex>(std::move(index));
  }
  absl::StatusOr<std::unique_ptr<RemoteKv>> remote = RemoteKv::Open(nodes, spec.node);
  if (!remote.ok()) return MarkShortOf(MemoryKind::kNodes, remote.status());
  if (spec.seed_nodes) TANDEM_RETURN_IF_ERROR(spec.seed_nodes(**remote));
  auto tier = std::make_unique<NodeTier>(std::move(*remote), std::move(pages));
  if (spec.node_recompute) tier->set_recompute(spec.node_recompute);
  return std::unique_ptr<OffloadTier>(std::move(tier));
}

}  // namespace

absl::StatusOr<std::unique_ptr<OffloadTier>> OpenOffloadTier(Backend& backend, NodePool* nodes,
                                                             const TierSpec& spec) {
  if (TraitsOf(spec.mode, spec.node.selection).entries_on_nodes && nodes == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(AttentionModeName(spec.mode)), " mode needs CPU attention nodes"));
  }
  switch (spec.mode) {
    case AttentionMode::kGpu:
      return std::unique_ptr<OffloadTier>();
    case AttentionMode::kHybrid:
      return OpenNodeTier(backend, *nodes, spec);
    case AttentionMode::kOffload: {
      absl::StatusOr<std::unique_ptr<OffloadedKv>> kv =
          OffloadedKv::Create(backend, spec.geometry, spec.host_page_tokens);
      if (!kv.ok()) return MarkShortOf(MemoryKind::kHost, kv.status());
      if (spec.seed_host) TANDEM_RETURN_IF_ERROR(spec.seed_host(**kv));
      return std::unique_ptr<OffloadTier>(std::make_unique<HostTier>(std::move(*kv)));
    }
    case AttentionMode::kExact: {
      if (spec.exact_rates == nullptr) {
        return absl::InvalidArgumentError("exact mode: no path rates to plan its split with");
      }
      TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<ExactTier> tier,
                              OpenExactTier(backend, *nodes, *spec.exact_rates, spec.node,
                                            spec.geometry, spec.host_page_tokens, spec.exact));
      if (spec.exact_recompute) tier->set_recompute(spec.exact_recompute);
      return std::unique_ptr<OffloadTier>(std::move(tier));
    }
  }
  return absl::InvalidArgumentError("unknown attention mode");
}

}  // namespace tandem::gpu_worker
