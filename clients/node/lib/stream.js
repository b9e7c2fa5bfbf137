'use strict';
// GenerateStream: one Generate call as an async iterable of events ({type: 'prefill'},
// {type: 'token'}, then one {type: 'final', result}).
//
// Cancellation: `cancel()`, the request's AbortSignal, or leaving a `for await` loop early
// (break, return, throw) cancels the call; the worker stops after the current token. A loop
// still waiting then throws `Cancelled`. The stream can be iterated once.

const { status } = require('@grpc/grpc-js');
const { Cancelled, TandemError, fromGrpcError } = require('./errors');
const { prefillEvent, tokenEvent, resultOf } = require('./events');

// Decoded messages buffered while the consumer is slower than the worker; past HIGH_WATER the
// call is paused (gRPC flow control then holds the worker's writes), resumed below LOW_WATER.
const HIGH_WATER = 256;
const LOW_WATER = 64;

class GenerateStream {
  constructor(call, signal) {
    this._call = call;
    this._queue = [];
    this._paused = false;
    this._error = null;
    this._ended = false;      // the call finished (OK or an error)
    this._cancelled = false;
    this._iterated = false;
    this._wake = null;
    this._tokens = [];
    this._result = null;

    call.on('data', (msg) => {
      this._queue.push(msg);
      if (!this._paused && this._queue.length >= HIGH_WATER) {
        this._paused = true;
        call.pause();
      }
      this._notify();
    });
    call.on('error', (err) => {   // a listener is always attached: never an unhandled 'error'
      this._error = fromGrpcError(err);
      this._finish();
    });
    call.on('end', () => this._finish());

    this._signal = signal;
    if (signal) {
      this._onAbort = () => this.cancel();
      if (signal.aborted) this.cancel();
      else signal.addEventListener('abort', this._onAbort, { once: true });
    }
  }

  /** The result once the final event was read, else null. */
  get result() { return this._result; }

  get cancelled() { return this._cancelled; }

  /** Cancels the call unless it already ended; safe to call more than once. */
  cancel() {
    if (this._ended || this._cancelled) return;
    this._cancelled = true;
    this._call.cancel();
  }

  /** Reads the rest of the stream; resolves to its result. */
  async collect() {
    // eslint-disable-next-line no-unused-vars
    for await (const _ of this) { /* the events are gathered into the result */ }
    if (!this._result) throw new Cancelled('the stream was cancelled before its result', status.CANCELLED);
    return this._result;
  }

  [Symbol.asyncIterator]() {
    if (this._iterated) throw new TypeError('a GenerateStream can be iterated only once');
    this._iterated = true;
    return this._events();
  }

  async *_events() {
    try {
      for (;;) {
        // Cancelled (cancel(), the signal): what is still buffered is dropped.
        if (this._cancelled) {
          throw this._error ?? new Cancelled('the call was cancelled by the client', status.CANCELLED);
        }
        if (this._queue.length > 0) {
          const msg = this._queue.shift();
          if (this._paused && this._queue.length <= LOW_WATER) {
            this._paused = false;
            this._call.resume();
          }
          const event = this._convert(msg);
          if (event) yield event;
          continue;
        }
        if (this._error) throw this._error;
        if (this._ended) {
          if (!this._result) {   // the contract is one `final` before OK
            throw new TandemError('the Generate stream ended without its final message', status.INTERNAL);
          }
          return;
        }
        await new Promise((resolve) => { this._wake = resolve; });
      }
    } finally {
      // Left early (break / return / throw in the loop body) or failed: stop the worker.
      this.cancel();
      this._detachSignal();
    }
  }

  _convert(msg) {
    switch (msg.event) {
      case 'prefill':
        return prefillEvent(msg.prefill);
      case 'token': {
        const token = tokenEvent(msg.token);
        this._tokens.push(token);
        return token;
      }
      case 'final':
        this._result = resultOf(msg.final, this._tokens);
        return { type: 'final', result: this._result, raw: msg.final };
      default:   // an event kind added to the proto later: passed on as decoded
        return msg.event ? { type: msg.event, raw: msg[msg.event] } : null;
    }
  }

  _finish() {
    this._ended = true;
    this._detachSignal();
    this._notify();
  }

  _notify() {
    const wake = this._wake;
    this._wake = null;
    if (wake) wake();
  }

  _detachSignal() {
    if (this._signal && this._onAbort) this._signal.removeEventListener('abort', this._onAbort);
  }
}

module.exports = { GenerateStream };
