// The memory plan for people (a table) and for programs (JSON): memory_plan.h.
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tandem/common/byte_size.h"
#include "tandem/common/status_macros.h"
#include "tandem/gpu_worker/memory_plan.h"

namespace tandem::gpu_worker {
namespace {

std::string RequestLine(const MemoryPlanRequest& r) {
  std::string line = absl::StrCat("mode ", std::string(AttentionModeName(r.mode)));
  if (r.mode == AttentionMode::kHybrid) {
    absl::StrAppend(&line, " (", std::string(SelectionRuleName(r.selection)), ")");
  }
  if (r.mode != AttentionMode::kGpu)
    absl::StrAppend(&line, ", window ", r.window, ", sink ", r.sink);
  absl::StrAppend(&line, ", context ", r.context, " (prompt ", r.prompt > 0 ? r.prompt : r.context,
                  "), batch ", r.batch);
  return line;
}

void AppendTier(const MemoryTier& tier, std::string& out) {
  if (tier.items.empty() && tier.capacity_bytes == 0) return;
  absl::StrAppendFormat(&out, "%s\n", tier.name);
  for (const MemoryItem& item : tier.items) {
    absl::StrAppendFormat(&out, "  %-28s %12s  %s\n", item.name, FormatBytes(item.bytes),
                          item.detail);
  }
  absl::StrAppendFormat(&out, "  %-28s %12s  of %s: %s\n", "total", FormatBytes(tier.total_bytes),
                        FormatBytes(tier.capacity_bytes),
                        tier.fits ? "fits" : absl::StrCat("DOES NOT FIT (", tier.why, ")"));
}

nlohmann::json TierJson(const MemoryTier& tier) {
  nlohmann::json items = nlohmann::json::array();
  for (const MemoryItem& item : tier.items) {
    items.push_back({{"name", item.name}, {"bytes", item.bytes}, {"detail", item.detail}});
  }
  return {{"items", items},
          {"total_bytes", tier.total_bytes},
          {"capacity_bytes", tier.capacity_bytes},
          {"fits", tier.fits},
          {"why", tier.why}};
}

void ToProto(const MemoryTier& tier, v1::CapacityTier* dst) {
  for (const MemoryItem& item : tier.items) {
    v1::CapacityItem* i = dst->add_items();
    i->set_name(item.name);
    i->set_bytes(item.bytes);
    i->set_detail(item.detail);
  }
  dst->set_total_bytes(tier.total_bytes);
  dst->set_capacity_bytes(tier.capacity_bytes);
  dst->set_fits(tier.fits);
  dst->set_why(tier.why);
}

}  // namespace

absl::Status AnswerCapacity(Engine& engine, const v1::GetCapacityRequest& request,
                            v1::GetCapacityResponse* response) {
  TANDEM_ASSIGN_OR_RETURN(const MemoryPlanSetup setup, SetupFromEngine(engine));
  MemoryPlanRequest r = MemoryPlanRequest::Defaults(setup.engine);
  if (request.context() < 0 || request.prompt() < 0 || request.batch() < 0) {
    return absl::InvalidArgumentError("context, prompt and batch must be >= 0");
  }
  r.context = request.context() > 0 ? request.context() : setup.max_context;
  r.prompt = request.prompt();
  r.batch = request.batch() > 0 ? request.batch() : 1;
  if (!request.mode().empty()) {
    absl::StatusOr<AttentionMode> mode = ParseAttentionMode(request.mode());
    if (!mode.ok())
      return absl::InvalidArgumentError(absl::StrCat("mode: ", mode.status().message()));
    r.mode = *mode;
  }
  if (request.has_window()) r.window = request.window();
  if (request.has_sink()) r.sink = request.sink();
  if (!request.selection().empty()) {
    absl::StatusOr<SelectionRule> selection = ParseSelectionRule(request.selection());
    if (!selection.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("selection: ", selection.status().message()));
    }
    r.selection = *selection;
  } else if (request.has_beta()) {
    r.selection = SelectionRule::kMaw;  // as Generate: beta without a selection means maw
  }
  if (request.has_select_tokens()) r.page_policy.select_tokens = request.select_tokens();
  if (request.has_beta()) {
    if (!(std::isfinite(request.beta()) && request.beta() >= 0)) {
      return absl::InvalidArgumentError("beta must be finite and >= 0");
    }
    r.beta = request.beta();
  }
  TANDEM_ASSIGN_OR_RETURN(MemoryPlan plan, EstimateMemory(setup, r));
  TANDEM_ASSIGN_OR_RETURN(plan.largest_context, LargestFittingContext(setup, r));
  response->set_context(r.context);
  response->set_prompt(r.prompt > 0 ? r.prompt : r.context);
  response->set_batch(r.batch);
  response->set_mode(std::string(AttentionModeName(r.mode)));
  ToProto(plan.device, response->mutable_device());
  ToProto(plan.host, response->mutable_host());
  ToProto(plan.nodes, response->mutable_nodes());
  for (size_t i = 0; i < plan.node_bytes.size(); ++i) {
    response->add_node_bytes(plan.node_bytes[i]);
    response->add_node_addresses(plan.node_addresses[i]);
    response->add_node_kv_storage(i < plan.node_kv_storage.size() ? plan.node_kv_storage[i] : "");
  }
  response->set_fits(plan.fits);
  response->set_largest_context(plan.largest_context);
  response->set_text(FormatMemoryPlan(plan));
  return absl::OkStatus();
}

std::string FormatMemoryPlan(const MemoryPlan& plan) {
  std::string out =
      absl::StrCat("memory plan: ", plan.model, "\n", RequestLine(plan.request), "\n");
  AppendTier(plan.device, out);
  AppendTier(plan.host, out);
  AppendTier(plan.nodes, out);
  for (size_t i = 0; i < plan.node_bytes.size(); ++i) {
    absl::StrAppendFormat(&out, "  node %-23s %12s  KV %s\n", plan.node_addresses[i],
                          FormatBytes(plan.node_bytes[i]),
                          i < plan.node_kv_storage.size() ? plan.node_kv_storage[i] : "");
  }
  absl::StrAppend(&out, plan.fits ? "fits\n" : "DOES NOT FIT\n");
  if (plan.largest_context >= 0) {
    absl::StrAppend(&out, "largest context that fits (batch ", plan.request.batch, ", mode ",
                    std::string(AttentionModeName(plan.request.mode)), "): ", plan.largest_context,
                    "\n");
  }
  return out;
}

std::string MemoryPlanJson(const MemoryPlan& plan) {
  const MemoryPlanRequest& r = plan.request;
  nlohmann::json j = {{"model", plan.model},
                      {"mode", std::string(AttentionModeName(r.mode))},
                      {"selection", std::string(SelectionRuleName(r.selection))},
                      {"window", r.window},
                      {"sink", r.sink},
                      {"context", r.context},
                      {"prompt", r.prompt > 0 ? r.prompt : r.context},
                      {"batch", r.batch},
                      {"device", TierJson(plan.device)},
                      {"host", TierJson(plan.host)},
                      {"nodes", TierJson(plan.nodes)},
                      {"node_bytes", plan.node_bytes},
                      {"node_addresses", plan.node_addresses},
                      {"node_kv_storage", plan.node_kv_storage},
                      {"fits", plan.fits}};
  if (plan.largest_context >= 0) j["largest_context"] = plan.largest_context;
  return j.dump(2);
}

}  // namespace tandem::gpu_worker
