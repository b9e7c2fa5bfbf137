'use strict';
// Typed errors of the tandem client: one class per gRPC status code the worker answers. Every
// failed call rejects (or throws while iterating) with a TandemError carrying the gRPC status
// `code` (a number, grpc.status), its name `codeName` and the worker's message `details`, which
// names the offending field ("max_tokens must be in 1..512, got 0").

const { status } = require('@grpc/grpc-js');

const CODE_NAMES = Object.fromEntries(Object.entries(status).map(([name, code]) => [code, name]));

class TandemError extends Error {
  constructor(details, code = status.UNKNOWN, metadata = undefined) {
    super(`${CODE_NAMES[code] ?? code}: ${details}`);
    this.name = new.target.name;
    this.code = code;
    this.codeName = CODE_NAMES[code] ?? String(code);
    this.details = details;
    this.metadata = metadata;
  }
}

function defineError(name, code) {
  // A named class per code, so `err instanceof NotFound` and `err.name === 'NotFound'` work.
  const cls = {
    [name]: class extends TandemError {
      constructor(details, codeArg = code, metadata = undefined) {
        super(details, codeArg, metadata);
      }
    },
  }[name];
  cls.code = code;
  return cls;
}

const InvalidArgument = defineError('InvalidArgument', status.INVALID_ARGUMENT);
const NotFound = defineError('NotFound', status.NOT_FOUND);
const FailedPrecondition = defineError('FailedPrecondition', status.FAILED_PRECONDITION);
const ResourceExhausted = defineError('ResourceExhausted', status.RESOURCE_EXHAUSTED);
const Unavailable = defineError('Unavailable', status.UNAVAILABLE);
const Cancelled = defineError('Cancelled', status.CANCELLED);
const DeadlineExceeded = defineError('DeadlineExceeded', status.DEADLINE_EXCEEDED);
const Internal = defineError('Internal', status.INTERNAL);

const BY_CODE = new Map(
  [InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted, Unavailable, Cancelled,
    DeadlineExceeded, Internal].map((cls) => [cls.code, cls]));

// The typed error for an error grpc-js emitted (a ServiceError: code, details, metadata).
function fromGrpcError(err) {
  if (err instanceof TandemError) return err;
  const code = typeof err.code === 'number' ? err.code : status.UNKNOWN;
  const Cls = BY_CODE.get(code) ?? TandemError;
  const error = new Cls(err.details || err.message || String(err), code, err.metadata);
  error.cause = err;
  return error;
}

module.exports = {
  TandemError,
  InvalidArgument,
  NotFound,
  FailedPrecondition,
  ResourceExhausted,
  Unavailable,
  Cancelled,
  DeadlineExceeded,
  Internal,
  fromGrpcError,
};
