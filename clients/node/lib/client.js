'use strict';
// Client: tandem's Generation service (a tandem-gpu-worker) over gRPC, and kept sessions.

const grpc = require('@grpc/grpc-js');
const { loadGeneration } = require('./proto');
const { buildGenerateRequest } = require('./request');
const { buildCapacityRequest, capacityOf } = require('./capacity');
const { GenerateStream } = require('./stream');
const { NotFound, fromGrpcError } = require('./errors');

// Unary calls (tokenize, detokenize, modelInfo, capacity, closeSession) get this deadline when
// neither the call nor the client sets one: a worker that stopped answering must not hang the
// caller. Generate streams run as long as the generation unless a timeout is given.
const UNARY_DEFAULT_TIMEOUT_MS = 60_000;
// The worker's default --max_message_bytes: a long prompt's token ids fit in one message.
const MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

function toMetadata(...sources) {
  const metadata = new grpc.Metadata();
  for (const source of sources) {
    if (!source) continue;
    if (source instanceof grpc.Metadata) {
      metadata.merge(source);
    } else {
      for (const [key, value] of Object.entries(source)) metadata.set(key, String(value));
    }
  }
  return metadata;
}

// A decoded message as a plain object. Its keys are camelCase already (proto-loader's
// keepCase: false), and every field is present (defaults: true), new ones included.
const plain = (msg) => ({ ...msg });

class Client {
  /**
   * address: "host:port". options: timeoutMs (each call's deadline; unset: unary calls 60 s,
   * streams unbounded), metadata (an object of header -> value, or a grpc.Metadata, sent with
   * every call), credentials (grpc.ChannelCredentials; default plaintext), protoDir (the folder
   * holding tandem/v1/*.proto; default $TANDEM_PROTO_DIR, else the checkout's proto/),
   * channelOptions (extra grpc channel arguments).
   */
  constructor(address, options = {}) {
    if (typeof address !== 'string' || address === '') {
      throw new TypeError('address must be a "host:port" string');
    }
    const { Generation, definition } = loadGeneration(options.protoDir);
    this._definition = definition;
    this.address = address;
    this.timeoutMs = options.timeoutMs;
    this.metadata = options.metadata;
    this._stub = new Generation(address, options.credentials ?? grpc.credentials.createInsecure(), {
      'grpc.max_receive_message_length': MAX_MESSAGE_BYTES,
      'grpc.max_send_message_length': MAX_MESSAGE_BYTES,
      ...options.channelOptions,
    });
  }

  /**
   * Starts a generation; returns a GenerateStream (async iterable of events). prompt: text or
   * token ids. opts: GenerateRequest fields (maxTokens required; temperature, topP, topK, stop,
   * seed, ignoreEos, logprobs, topLogprobs, mode ('gpu', 'hybrid', 'offload' or 'exact'),
   * beta, window, sink, selection, selectTokens, denseLayers; snake_case works too) and
   * sessionId, timeoutMs, signal (AbortSignal), metadata.
   * Throws TypeError for a bad option; the worker's refusals are thrown while iterating.
   */
  generate(prompt, opts = {}) {
    const request = buildGenerateRequest(this._definition, prompt, opts);
    const call = this._stub.Generate(request, toMetadata(this.metadata, opts.metadata),
      this._callOptions(opts.timeoutMs, false));
    return new GenerateStream(call, opts.signal);
  }

  /** generate() read to its end: resolves to the result (text, tokenIds, usage, ...). */
  async complete(prompt, opts = {}) {
    return this.generate(prompt, opts).collect();
  }

  /** Token ids of text with the model's tokenizer (BOS first when addBos). */
  async tokenize(text, opts = {}) {
    if (typeof text !== 'string') throw new TypeError('text must be a string');
    const response = await this._unary('Tokenize', { text, addBos: Boolean(opts.addBos) }, opts);
    return response.tokenIds;
  }

  /** The text of token ids. */
  async detokenize(tokenIds, opts = {}) {
    if (!Array.isArray(tokenIds) || !tokenIds.every(Number.isInteger)) {
      throw new TypeError('tokenIds must be an array of integers');
    }
    const response = await this._unary('Detokenize', { tokenIds }, opts);
    return response.text;
  }

  /** The loaded model, backend and CPU nodes (ModelInfoResponse's fields, camelCase). */
  async modelInfo(opts = {}) {
    return plain(await this._unary('GetModelInfo', {}, opts));
  }

  /**
   * The worker's memory plan (GetCapacity) of a request: opts are GetCapacityRequest's fields
   * (context: positions per sequence, prompt + generated, 0 = max_context; prompt: of those the
   * prompt, 0 = all; batch: sequences, 0 = 1; mode, window, sink, selection, selectTokens, beta
   * as in generate(), unset = the worker's defaults) plus timeoutMs and metadata. Resolves to
   * { context, prompt, batch, mode, device, host, nodes (tiers: items, totalBytes,
   * capacityBytes, fits, why), nodeBytes, nodeAddresses, fits, why, largestContext, text }.
   * Rejects with TypeError for a bad option (nothing is sent), InvalidArgument for a value the
   * worker refuses (a context above max_context, an unknown mode).
   */
  async capacity(opts = {}) {
    const request = buildCapacityRequest(this._definition, opts);
    return capacityOf(await this._unary('GetCapacity', request, opts));
  }

  /** A handle on a kept session (created by its first turn; nothing is sent now). */
  session(sessionId) {
    return new Session(this, sessionId);
  }

  /**
   * Runs fn(session) and closes the session afterwards, whatever fn did (a session that never
   * ran a turn does not exist on the worker: closing it then is quiet). Resolves to fn's value.
   */
  async withSession(sessionId, fn) {
    const session = this.session(sessionId);
    try {
      return await fn(session);
    } finally {
      await session.close().catch((err) => { if (!(err instanceof NotFound)) throw err; });
    }
  }

  /** Frees a kept session on the worker; rejects with NotFound when it does not exist. */
  async closeSession(sessionId, opts = {}) {
    await this._unary('CloseSession', { sessionId }, opts);
  }

  /** Closes the channel; calls in flight are cancelled. */
  close() {
    this._stub.close();
  }

  _callOptions(timeoutMs, unary) {
    const ms = timeoutMs ?? this.timeoutMs ?? (unary ? UNARY_DEFAULT_TIMEOUT_MS : undefined);
    return ms === undefined ? {} : { deadline: new Date(Date.now() + ms) };
  }

  _unary(method, request, opts) {
    return new Promise((resolve, reject) => {
      this._stub[method](request, toMetadata(this.metadata, opts.metadata),
        this._callOptions(opts.timeoutMs, true),
        (err, response) => (err ? reject(fromGrpcError(err)) : resolve(response)));
    });
  }
}

/** A kept session: each turn continues its KV. */
class Session {
  constructor(client, sessionId) {
    if (typeof sessionId !== 'string') throw new TypeError('sessionId must be a string');
    this.client = client;
    this.id = sessionId;
  }

  /** A turn: client.generate() with this session's id. */
  generate(prompt, opts = {}) {
    return this.client.generate(prompt, { ...opts, sessionId: this.id });
  }

  /** A turn read to its end. */
  complete(prompt, opts = {}) {
    return this.client.complete(prompt, { ...opts, sessionId: this.id });
  }

  /** Frees the session on the worker; rejects with NotFound when it does not exist. */
  close(opts = {}) {
    return this.client.closeSession(this.id, opts);
  }
}

module.exports = { Client, Session };
