// The Responses API routes (POST /v1/responses, GET and DELETE /v1/responses/{id}). A request
// runs as a chat request (generation_handler.h, RunGeneration) over the stored conversation of
// its previous_response_id, its instructions and its input; a stored answer (store: true, the
// default) keeps that conversation plus the answer (response_store.h), so the next turn's prompt
// starts with this one's and the worker's prefix cache serves it. Private to tandem::gateway.
#pragma once

#include <httplib.h>

#include <string_view>

#include "generation_handler.h"

namespace tandem::gateway {

void HandleResponses(GatewayServer::Shared& shared, const httplib::Request& req,
                     std::string_view body, httplib::Response& res);
// GET /v1/responses/{id}: the stored response object; 404 for an unknown id or another API
// key's.
void HandleGetResponse(GatewayServer::Shared& shared, const httplib::Request& req,
                       httplib::Response& res);
// DELETE /v1/responses/{id}: {id, object: "response", deleted: true}; 404 as GET.
void HandleDeleteResponse(GatewayServer::Shared& shared, const httplib::Request& req,
                          httplib::Response& res);

}  // namespace tandem::gateway
