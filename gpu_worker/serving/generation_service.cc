#include "tandem/gpu_worker/generation_service.h"

#include <atomic>
#include <cmath>
#include <deque>
#include <functional>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/common/grpc_status.h"
#include "tandem/gpu_worker/memory_plan.h"
#include "prompt_encoder.h"
#include "session_ownership.h"
#include "tandem/common/status_macros.h"
#include "tandem/rpc_message/raw_message.h"

namespace tandem::gpu_worker {
namespace {

using rpc_message::ParseRequest;
using rpc_message::SerializeReply;

// Runs `work` on the scheduler thread (between steps) and finishes the unary reactor with its status. A call the
// client already cancelled is finished as CANCELLED without running.
template <typename Work>
grpc::ServerUnaryReactor* RunUnary(Scheduler& scheduler, grpc::CallbackServerContext* context,
                                   Work work) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const bool posted = scheduler.Post([reactor, context, work](Engine& engine) {
    if (context->IsCancelled()) {
      reactor->Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled before it ran"));
      return;
    }
    reactor->Finish(ToGrpcStatus(work(engine)));
  });
  if (!posted) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the worker is shutting down"));
  }
  return reactor;
}

}  // namespace

absl::StatusOr<GenerateRequest> ToEngineRequest(const v1::GenerateRequest& request,
                                                int64_t max_context) {
  GenerateRequest dst;
  dst.session_id = request.session_id();
  if (request.cache_salt().size() > 256) {
    return absl::InvalidArgumentError(absl::StrCat("cache_salt: ", request.cache_salt().size(),
                                                   " bytes; at most 256"));
  }
  dst.cache_salt = request.cache_salt();
  switch (request.prompt_case()) {
    case v1::GenerateRequest::kPromptText:
      dst.prompt_text = request.prompt_text();
      break;
    case v1::GenerateRequest::kPromptIds:
      dst.prompt_ids.assign(request.prompt_ids().ids().begin(), request.prompt_ids().ids().end());
      break;
    case v1::GenerateRequest::PROMPT_NOT_SET:
      break;
  }
  if (dst.prompt_text.empty() && dst.prompt_ids.empty()) {
    return absl::InvalidArgumentError("prompt: empty; set prompt_text or prompt_ids");
  }

  dst.max_tokens = request.max_tokens();
  dst.sampling.temperature = request.temperature();
  // 0 (unset) = 1; a negative or NaN value stays and is refused by the validator.
  dst.sampling.top_p = request.top_p() == 0 ? 1.0f : request.top_p();
  dst.sampling.top_k = request.top_k();
  if (request.has_seed()) dst.sampling.seed = request.seed();
  dst.stop.assign(request.stop().begin(), request.stop().end());
  dst.ignore_eos = request.ignore_eos();
  dst.logprobs = request.logprobs();
  dst.top_logprobs = request.top_logprobs();

  if (!request.mode().empty()) {
    absl::StatusOr<AttentionMode> mode = ParseAttentionMode(request.mode());
    if (!mode.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("mode: unknown '", request.mode(), "' (expected gpu, hybrid, offload or exact)"));
    }
    dst.mode = *mode;
  }
  if (request.has_beta()) dst.beta = request.beta();
  if (request.has_window()) dst.window = request.window();
  if (request.has_sink()) dst.sink = request.sink();
  if (!request.selection().empty()) {
    absl::StatusOr<SelectionRule> selection = ParseSelectionRule(request.selection());
    if (!selection.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "selection: unknown '", request.selection(), "' (expected maw or pages)"));
    }
    dst.selection = *selection;
  }
  if (request.has_select_tokens()) dst.select_tokens = request.select_tokens();
  if (request.has_dense_layers()) dst.dense_layers = request.dense_layers();
  TANDEM_RETURN_IF_ERROR(ValidateGenerateRequest(dst, max_context));
  return dst;
}

v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kEos:
      return v1::FINISH_REASON_EOS;
    case FinishReason::kContext:
      return v1::FINISH_REASON_CONTEXT;
    case FinishReason::kCancelled:
      return v1::FINISH_REASON_CANCELLED;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

std::string_view FinishReasonName(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_EOS:
      return "eos";
    case v1::FINISH_REASON_CONTEXT:
      return "context";
    case v1::FINISH_REASON_CANCELLED:
      return "cancelled";
    default:
      return "unspecified";
  }
}

void ToProto(const PrefillProgress& progress, v1::PrefillProgress* dst) {
  dst->set_total(progress.total);
  dst->set_processed(progress.processed);
  dst->set_elapsed_seconds(progress.elapsed_s);
}

void ToProto(const TokenEvent& token, v1::TokenDelta* dst) {
  dst->set_token_id(token.token_id);
  dst->set_text(token.text);
  dst->set_index(token.index);
  if (token.logprob.has_value()) dst->set_logprob(*token.logprob);
  for (const TokenAlternative& alternative : token.top_logprobs) {
    v1::TokenLogprob* top = dst->add_top_logprobs();
    top->set_token_id(alternative.token_id);
    top->set_text(alternative.text);
    top->set_raw(alternative.raw);
    top->set_logprob(alternative.logprob);
  }
}

void ToProto(const GenerateSummary& summary, v1::GenerateFinal* dst) {
  v1::Usage* usage = dst->mutable_usage();
  usage->set_prompt_tokens(summary.prompt_tokens);
  usage->set_completion_tokens(summary.completion_tokens);
  usage->set_total_tokens(summary.prompt_tokens + summary.completion_tokens);
  usage->set_cached_tokens(summary.cached_tokens);
  dst->set_time_to_first_token_seconds(summary.time_to_first_token_s);
  dst->set_mean_token_latency_seconds(summary.mean_token_latency_s);
  dst->set_p50_token_latency_seconds(summary.p50_token_latency_s);
  dst->set_p99_token_latency_seconds(summary.p99_token_latency_s);
  dst->set_total_seconds(summary.total_s);
  dst->set_finish_reason(ToProto(summary.finish_reason));
  dst->set_degraded(summary.degraded);
  dst->set_degraded_steps(summary.degraded_steps);
  dst->set_device_kv_entries(summary.device_kv_entries);
  dst->set_cpu_kv_entries(summary.cpu_kv_entries);
  dst->set_session_id(summary.session_id);
  dst->set_mode(std::string(AttentionModeName(summary.mode)));
  if (summary.exact_split.has_value()) {
    const TierSplit& e = *summary.exact_split;
    v1::ExactSplit* split = dst->mutable_exact_split();
    split->set_fetch_share(e.fetch_share);
    split->set_node_share(e.node_share);
    split->set_recompute_share(e.recompute_share);
    split->set_modelled_step_seconds(e.modelled_step_s);
    split->set_modelled_fetch_only_seconds(e.modelled_fetch_only_s);
    split->set_recompute_pays(e.recompute_pays);
    split->set_recompute_reason(e.recompute_reason);
    split->set_host_entries(e.host_entries);
    split->set_node_entries(e.node_entries);
  }
}

void ToProto(const ModelInfo& info, v1::ModelInfoResponse* dst) {
  dst->set_model_dir(info.model_dir);
  dst->set_model_type(info.model_type);
  dst->set_backend(info.backend);
  dst->set_device(info.device);
  dst->set_num_layers(info.num_layers);
  dst->set_num_q_heads(info.num_q_heads);
  dst->set_num_kv_heads(info.num_kv_heads);
  dst->set_head_dim(info.head_dim);
  dst->set_hidden_size(info.hidden_size);
  dst->set_vocab_size(info.vocab_size);
  dst->set_max_context(info.max_context);
  dst->set_weight_dtype(info.weight_dtype);
  dst->set_kv_dtype(info.kv_dtype);
  dst->set_weight_bytes(info.weight_bytes);
  dst->set_cpu_nodes(info.cpu_nodes);
  dst->set_tokenizer_kind(info.tokenizer_kind);
  dst->set_chat_template(info.chat_template);
  dst->set_bos_token(info.bos_token);
  dst->set_eos_token(info.eos_token);
  dst->mutable_eos_token_ids()->Add(info.eos_token_ids.begin(), info.eos_token_ids.end());
  const SamplingDefaults& d = info.sampling_defaults;
  if (d.temperature.has_value()) dst->set_default_temperature(*d.temperature);
  if (d.top_p.has_value()) dst->set_default_top_p(*d.top_p);
  if (d.top_k.has_value()) dst->set_default_top_k(*d.top_k);
}

// One Generate call. The scheduler produces its messages through the callbacks (Enqueue) and
// ends with EndJob (its `done`); gRPC takes them one StartWrite at a time (OnWriteDone starts
// the next). Finish is called exactly once, only after EndJob, so the scheduler never touches a
// deleted reactor; after Finish nothing
// touches `this` and OnDone deletes it. NOTE: the queue is not bounded by the client's pace: a
// slow reader costs at most max_tokens small messages of memory, never a blocked scheduler.
class GenerationService::GenerateReactor final
    : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  // Submits the request; finishes with its error if the scheduler does not take it. `on_end`
  // (may be empty) runs once with whether the call succeeded and its session stays open.
  void Start(Scheduler& scheduler, GenerateRequest request,
             std::function<void(bool kept)> on_end = {}) {
    GenerateCallbacks callbacks;
    callbacks.on_prefill = [this](const PrefillProgress& progress) {
      v1::GenerateResponse message;
      ToProto(progress, message.mutable_prefill());
      Enqueue(std::move(message));
    };
    callbacks.on_token = [this](const TokenEvent& token) {
      if (cancelled_.load()) return false;
      v1::GenerateResponse message;
      ToProto(token, message.mutable_token());
      Enqueue(std::move(message));
      return true;
    };
    callbacks.cancelled = [this] { return cancelled_.load(); };
    const absl::Status submitted = scheduler.Submit(
        std::move(request), std::move(callbacks),
        [this, on_end](absl::StatusOr<GenerateSummary> summary) {
          if (on_end) on_end(summary.ok() && !summary->session_id.empty());
          if (!summary.ok()) {
            EndJob(ToGrpcStatus(summary.status()));
            return;
          }
          v1::GenerateResponse message;
          ToProto(*summary, message.mutable_final());
          Enqueue(std::move(message));
          EndJob(grpc::Status::OK);
        });
    if (!submitted.ok()) {
      if (on_end) on_end(false);
      EndJob(ToGrpcStatus(submitted));
    }
  }

  void OnWriteDone(bool ok) override {
    std::unique_lock<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) {  // the client is gone: stop generating, drop what is queued
      write_failed_ = true;
      cancelled_.store(true);
      queue_.clear();
    }
    Pump(std::move(lock));
  }

  void OnCancel() override { cancelled_.store(true); }
  void OnDone() override { delete this; }

 private:
  void Enqueue(const v1::GenerateResponse& message) {
    grpc::ByteBuffer bytes;
    const absl::Status serialized = SerializeReply(message, &bytes);
    std::unique_lock<std::mutex> lock(mu_);
    if (!serialized.ok()) {   // the stream cannot go on: stop generating, end with the error
      if (broken_.ok()) broken_ = serialized;
      cancelled_.store(true);
      return;
    }
    if (write_failed_ || !broken_.ok()) return;
    queue_.push_back(std::move(bytes));
    Pump(std::move(lock));
  }

  // The job's last call: the reactor may be deleted by the time it returns.
  void EndJob(grpc::Status status) {
    std::unique_lock<std::mutex> lock(mu_);
    job_ended_ = true;
    status_ = std::move(status);
    Pump(std::move(lock));
  }

  // Starts the next write, or finishes once the job ended and the queue drained. Releases
  // `lock` before calling into gRPC (its callbacks may run inline and take mu_).
  void Pump(std::unique_lock<std::mutex> lock) {
    if (writing_ || finished_) return;
    if (!queue_.empty()) {
      current_ = std::move(queue_.front());
      queue_.pop_front();
      writing_ = true;
      lock.unlock();
      StartWrite(&current_);
      return;
    }
    if (!job_ended_) return;
    finished_ = true;
    const grpc::Status status =
        write_failed_ ? grpc::Status(grpc::StatusCode::CANCELLED, "the client went away")
        : !broken_.ok() ? ToGrpcStatus(broken_)
                        : status_;
    lock.unlock();
    Finish(status);  // `this` may be gone from here on
  }

  std::mutex mu_;
  std::deque<grpc::ByteBuffer> queue_;      // serialized v1::GenerateResponse, guarded by mu_
  bool writing_ = false;                    // a StartWrite of current_ is outstanding
  bool job_ended_ = false;
  bool write_failed_ = false;
  bool finished_ = false;               // Finish was called
  grpc::Status status_;                 // the job's result, valid once job_ended_
  absl::Status broken_;                 // a message could not be serialized (guarded by mu_)
  grpc::ByteBuffer current_;            // the message being written
  std::atomic<bool> cancelled_{false};  // client cancelled or went away
};

GenerationService::GenerationService(Scheduler* scheduler, const ModelInfo& info,
                                     const Tokenizer& tokenizer, ServiceSecurity security)
    : scheduler_(scheduler),
      max_context_(info.max_context),
      vocab_size_(info.vocab_size),
      authenticator_(std::move(security.authenticator)),
      owners_(authenticator_.identifies_callers() || security.max_sessions_per_principal > 0
                  ? std::make_unique<internal::SessionOwnership>(
                        security.max_sessions_per_principal)
                  : nullptr),
      encoder_(std::make_unique<PromptEncoder>(tokenizer, info.max_context)),
      tokenizer_(tokenizer) {}

absl::StatusOr<std::function<void(bool kept)>> GenerationService::ClaimSession(
    const std::string& id, const std::string& principal) {
  TANDEM_RETURN_IF_ERROR(owners_->Claim(id, principal).status());
  internal::SessionOwnership* owners = owners_.get();
  Scheduler* scheduler = scheduler_;
  return std::function<void(bool)>([owners, scheduler, id](bool kept) {
    if (!owners->Finished(id, kept)) return;
    // Never kept: whatever the failed first request left in the engine goes too, so the
    // forgotten id cannot be continued by another caller.
    scheduler->Post([id](Engine& engine) {
      if (!engine.SessionBusy(id)) engine.CloseSession(id).IgnoreError();
    });
  });
}

GenerationService::~GenerationService() = default;

grpc::ServerWriteReactor<grpc::ByteBuffer>* GenerationService::Generate(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request_bytes) {
  auto* reactor = new GenerateReactor();
  absl::StatusOr<std::string> principal = authenticator_.Authenticate(*context);
  if (!principal.ok()) {
    reactor->Finish(ToGrpcStatus(principal.status()));
    return reactor;
  }
  v1::GenerateRequest request;
  const absl::Status parsed = ParseRequest(*request_bytes, &request);
  absl::StatusOr<GenerateRequest> converted =
      parsed.ok() ? ToEngineRequest(request, max_context_) : parsed;
  if (!converted.ok()) {
    reactor->Finish(ToGrpcStatus(converted.status()));
  } else {
    // The call's deadline bounds the generation (checked between steps).
    const auto deadline = context->deadline();
    if (deadline != std::chrono::system_clock::time_point::max()) {
      converted->deadline = std::chrono::steady_clock::now() +
                            std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                deadline - std::chrono::system_clock::now());
    }
    converted->principal = *principal;   // the prefix cache's scope
    std::function<void(bool)> on_end;
    if (owners_ != nullptr && !converted->session_id.empty()) {
      absl::StatusOr<std::function<void(bool)>> claimed =
          ClaimSession(converted->session_id, *principal);
      if (!claimed.ok()) {
        reactor->Finish(ToGrpcStatus(claimed.status()));
        return reactor;
      }
      on_end = *std::move(claimed);
    }
    if (converted->prompt_ids.empty()) {
      // A text prompt: refused at once when it cannot fit, else tokenized on the encoder's
      // threads, and only then handed to the scheduler.
      StartAfterEncoding(reactor, *std::move(converted), std::move(on_end));
      return reactor;
    }
    reactor->Start(*scheduler_, *std::move(converted), std::move(on_end));
  }
  return reactor;
}

void GenerationService::StartAfterEncoding(GenerateReactor* reactor, GenerateRequest request,
                                           std::function<void(bool kept)> on_end) {
  auto refuse = [reactor, on_end](const absl::Status& status) {
    if (on_end) on_end(false);
    reactor->Finish(ToGrpcStatus(status));
  };
  if (absl::Status fits = encoder_->CheckFits(request.prompt_text); !fits.ok()) {
    return refuse(fits);
  }
  std::string text = std::move(request.prompt_text);
  auto pending = std::make_shared<GenerateRequest>(std::move(request));
  Scheduler* scheduler = scheduler_;
  const absl::Status queued = encoder_->Encode(
      std::move(text), [reactor, scheduler, pending, on_end, refuse](
                           absl::StatusOr<std::vector<int32_t>> ids) {
        if (!ids.ok()) return refuse(ids.status());
        pending->prompt_text_ids = *std::move(ids);
        reactor->Start(*scheduler, std::move(*pending), on_end);
      });
  if (!queued.ok()) refuse(queued);
}

grpc::ServerUnaryReactor* GenerationService::Tokenize(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* request_bytes,
                                                      grpc::ByteBuffer* response_bytes) {
  if (absl::StatusOr<std::string> principal = authenticator_.Authenticate(*context);
      !principal.ok()) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpcStatus(principal.status()));
    return reactor;
  }
  auto request = std::make_shared<v1::TokenizeRequest>();
  if (absl::Status parsed = ParseRequest(*request_bytes, request.get()); !parsed.ok()) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpcStatus(parsed));
    return reactor;
  }
  // Off the scheduler thread, as Generate's text prompts; any text within the context's bound.
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status fits = encoder_->CheckFits(request->text()); !fits.ok()) {
    reactor->Finish(ToGrpcStatus(fits));
    return reactor;
  }
  const Tokenizer* tokenizer = &tokenizer_;
  const absl::Status queued = encoder_->Encode(
      request->text(), [reactor, request, response_bytes, tokenizer](
                           absl::StatusOr<std::vector<int32_t>> ids) {
        if (!ids.ok()) return reactor->Finish(ToGrpcStatus(ids.status()));
        if (request->add_bos()) AddPromptBos(*tokenizer, &*ids);
        v1::TokenizeResponse response;
        response.mutable_token_ids()->Add(ids->begin(), ids->end());
        response.set_count(static_cast<int64_t>(ids->size()));
        reactor->Finish(ToGrpcStatus(SerializeReply(response, response_bytes)));
      });
  if (!queued.ok()) reactor->Finish(ToGrpcStatus(queued));
  return reactor;
}

grpc::ServerUnaryReactor* GenerationService::Detokenize(grpc::CallbackServerContext* context,
                                                        const v1::DetokenizeRequest* request,
                                                        v1::DetokenizeResponse* response) {
  if (absl::StatusOr<std::string> principal = authenticator_.Authenticate(*context);
      !principal.ok()) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpcStatus(principal.status()));
    return reactor;
  }
  for (int i = 0; i < request->token_ids_size(); ++i) {
    const int32_t id = request->token_ids(i);
    if (id < 0 || id >= vocab_size_) {
      grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
      reactor->Finish(ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "token_ids[", i, "] = ", id, " is outside the vocabulary [0, ", vocab_size_, ")"))));
      return reactor;
    }
  }
  return RunUnary(*scheduler_, context, [request, response](Engine& engine) {
    std::vector<int32_t> ids(request->token_ids().begin(), request->token_ids().end());
    response->set_text(engine.Detokenize(ids));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GenerationService::CloseSession(
    grpc::CallbackServerContext* context, const v1::CloseGenerationSessionRequest* request,
    v1::CloseGenerationSessionResponse* response) {
  absl::StatusOr<std::string> principal = authenticator_.Authenticate(*context);
  absl::Status refused = principal.status();
  if (refused.ok() && request->session_id().empty()) {
    refused = absl::InvalidArgumentError("session_id: empty");
  }
  if (refused.ok() && owners_ != nullptr) {
    refused = owners_->CheckOwner(request->session_id(), *principal);
  }
  if (!refused.ok()) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpcStatus(refused));
    return reactor;
  }
  internal::SessionOwnership* owners = owners_.get();
  return RunUnary(*scheduler_, context, [request, owners](Engine& engine) {
    absl::Status closed = engine.CloseSession(request->session_id());
    if (owners != nullptr && (closed.ok() || absl::IsNotFound(closed))) {
      owners->Forget(request->session_id());
    }
    return closed;
  });
}

grpc::ServerUnaryReactor* GenerationService::GetModelInfo(grpc::CallbackServerContext* context,
                                                          const v1::GetModelInfoRequest* request,
                                                          v1::ModelInfoResponse* response) {
  if (absl::StatusOr<std::string> principal = authenticator_.Authenticate(*context);
      !principal.ok()) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpcStatus(principal.status()));
    return reactor;
  }
  return RunUnary(*scheduler_, context, [response](Engine& engine) {
    ToProto(engine.info(), response);
    response->set_open_sessions(engine.open_sessions());
    response->set_prefix_cache_sessions(engine.kv_cache().cached_sessions());
    response->set_prefix_cache_tokens(engine.kv_cache().prefix().cached_tokens());
    response->set_prefix_cache_evictions(engine.kv_cache().evictions());
    response->set_prefix_cache_parked_sessions(engine.kv_cache().parked_sessions());
    response->set_prefix_cache_host_bytes(engine.kv_cache().host_bytes());
    response->set_prefix_cache_host_budget_bytes(
        engine.options().prefix_cache_host_bytes.value_or(0));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GenerationService::GetCapacity(grpc::CallbackServerContext* context,
                                                         const v1::GetCapacityRequest* request,
                                                         v1::GetCapacityResponse* response) {
  if (absl::StatusOr<std::string> principal = authenticator_.Authenticate(*context);
      !principal.ok()) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpcStatus(principal.status()));
    return reactor;
  }
  return RunUnary(*scheduler_, context, [request, response](Engine& engine) {
    return AnswerCapacity(engine, *request, response);
  });
}

}  // namespace tandem::gpu_worker
