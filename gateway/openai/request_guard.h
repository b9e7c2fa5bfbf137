// What the gateway checks of a request before and while reading its body, so that a client that
// lies about its length or sends it slowly is answered within bounds instead of holding a
// connection thread (its own and, with enough connections, everyone's):
//   - Content-Length must be decimal digits within --max_body_bytes (-1, 1e20 or a value too
//     large: 400 / 413 at once, before any body is read; a form-encoded body over httplib's form
//     cap: 413 saying to send JSON); Content-Length with Transfer-Encoding
//     is refused (RFC 9112 6.3: a request-smuggling shape);
//   - the body must arrive within body_timeout of the end of the headers (408), on top of the
//     per-read idle limit (--read_timeout_s) that httplib applies to each read.
// Every refusal closes the connection (the unread rest of the body cannot be resynchronised).
#pragma once

#include <httplib.h>

#include <chrono>
#include <cstddef>
#include <string>

#include "tandem/gateway/api_error.h"

namespace tandem::gateway {

// The error for a request whose framing headers are unacceptable; http_status 0 when they are
// fine.
ApiError CheckBodyFraming(const httplib::Request& req, size_t max_body_bytes);

// The 413 message for a form-encoded body over httplib's form cap (here for one with a
// Content-Length; the error handler for a chunked one, which httplib caps itself).
std::string FormBodyTooLargeMessage();

// Reads the body through `reader` into `body` (reserving Content-Length, which
// CheckBodyFraming has bounded); false when it did not arrive whole within
// `timeout` (then `error` says why: 408 for the deadline or a read that failed, e.g. the idle
// limit or a client that hung up).
bool ReadBodyWithin(const httplib::Request& req, const httplib::ContentReader& reader,
                    std::chrono::milliseconds timeout, std::string* body, ApiError* error);

// Answers `res` with `error` and asks httplib to close the connection after it.
void RefuseAndClose(const ApiError& error, httplib::Response& res);

}  // namespace tandem::gateway
