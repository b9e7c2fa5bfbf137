'use strict';
// @tandem/client: Node client of tandem's Generation service (tandem-gpu-worker, gRPC).
// Types: index.d.ts. Usage: README.md.

const { Client, Session } = require('./lib/client');
const { GenerateStream } = require('./lib/stream');
const {
  TandemError, InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted, Unavailable,
  Cancelled, DeadlineExceeded, Internal,
} = require('./lib/errors');

module.exports = {
  Client,
  Session,
  GenerateStream,
  TandemError,
  InvalidArgument,
  NotFound,
  FailedPrecondition,
  ResourceExhausted,
  Unavailable,
  Cancelled,
  DeadlineExceeded,
  Internal,
};
