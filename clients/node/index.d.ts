// Types of @tandem/client (hand-written next to the plain JS in index.js and lib/). Field names
// follow proto/tandem/v1/generation.proto in camelCase; int64 fields are JS numbers.

import type { ChannelCredentials, ChannelOptions, Metadata } from '@grpc/grpc-js';

export interface ClientOptions {
  /** Deadline of each call in ms. Unset: unary calls 60 s, Generate streams unbounded. */
  timeoutMs?: number;
  /** Sent with every call. */
  metadata?: Record<string, string> | Metadata;
  /** TLS; default plaintext. */
  credentials?: ChannelCredentials;
  /** Folder holding tandem/v1/*.proto; default $TANDEM_PROTO_DIR, else the checkout's proto/. */
  protoDir?: string;
  channelOptions?: ChannelOptions;
}

export interface CallOptions {
  timeoutMs?: number;
  metadata?: Record<string, string> | Metadata;
}

/** GenerateRequest's fields (see generation.proto for ranges and defaults). */
export interface GenerateOptions extends CallOptions {
  /** Tokens to generate at most (required by the worker): 1..max_context. */
  maxTokens?: number;
  /** 0 (default) = greedy. */
  temperature?: number;
  topP?: number;
  topK?: number;
  stop?: string | string[];
  seed?: number | bigint | string;
  ignoreEos?: boolean;
  /** Each token event then carries its log-probability. */
  logprobs?: boolean;
  /** 0..20 likeliest tokens per step (needs logprobs). */
  topLogprobs?: number;
  /** "gpu" | "hybrid" | "offload"; default the worker's --mode. */
  mode?: string;
  beta?: number;
  window?: number;
  sink?: number;
  /** "pages" | "maw". */
  selection?: string;
  selectTokens?: number;
  denseLayers?: number;
  /** Continue (or create) this kept session. */
  sessionId?: string;
  /** Aborting cancels the call; the loop then throws Cancelled. */
  signal?: AbortSignal;
  /** A GenerateRequest field added to the proto later (camelCase or snake_case). */
  [field: string]: unknown;
}

export type Prompt = string | number[];

export interface PrefillEvent {
  type: 'prefill';
  /** Prompt tokens this request prefills. */
  total: number;
  /** Of those, processed so far (=== total in the last one). */
  processed: number;
  elapsedSeconds: number;
  raw: Record<string, unknown>;
}

export interface TopLogprob {
  id: number;
  /** The token decoded alone (U+FFFD for a partial UTF-8 character). */
  text: string;
  /** The token's exact bytes. */
  bytes: Uint8Array;
  /** Natural log, <= 0. */
  logprob: number;
}

export interface TokenEvent {
  type: 'token';
  id: number;
  /** May be empty while a partial character or a possible stop string is held back. */
  text: string;
  /** 0 for the request's first generated token. */
  index: number;
  /** Set when the request asked for logprobs. */
  logprob?: number;
  /** topLogprobs likeliest tokens of the step, likeliest first. */
  topLogprobs: TopLogprob[];
  raw: Record<string, unknown>;
}

export interface Usage {
  promptTokens: number;
  completionTokens: number;
  totalTokens: number;
}

export type FinishReason = 'length' | 'stop' | 'eos' | 'context' | 'cancelled';

export interface Result {
  /** The generated text (the prompt is not repeated). */
  text: string;
  tokenIds: number[];
  tokens: TokenEvent[];
  usage: Usage;
  finishReason: FinishReason | string;
  timeToFirstTokenSeconds: number;
  meanTokenLatencySeconds: number;
  p50TokenLatencySeconds: number;
  p99TokenLatencySeconds: number;
  totalSeconds: number;
  /** Some step ran without a CPU node's answer. */
  degraded: boolean;
  degradedSteps: number;
  /** KV entries per (layer, kv head) on the device / the CPU nodes at the end. */
  deviceKvEntries: number;
  cpuKvEntries: number;
  /** "" for a one-shot request. */
  sessionId: string;
  mode: string;
  raw: Record<string, unknown>;
}

export interface FinalEvent {
  type: 'final';
  result: Result;
  raw: Record<string, unknown>;
}

export type GenerateEvent = PrefillEvent | TokenEvent | FinalEvent;

export declare class GenerateStream implements AsyncIterable<GenerateEvent> {
  /** The result once the final event was read, else null. */
  readonly result: Result | null;
  readonly cancelled: boolean;
  /** Cancels the call unless it already ended. */
  cancel(): void;
  /** Reads the rest of the stream. */
  collect(): Promise<Result>;
  /** Once only; leaving the loop early cancels the call. */
  [Symbol.asyncIterator](): AsyncIterator<GenerateEvent>;
}

export interface ModelInfo {
  modelDir: string;
  modelType: string;
  backend: string;
  device: string;
  numLayers: number;
  numQHeads: number;
  numKvHeads: number;
  headDim: number;
  hiddenSize: number;
  vocabSize: number;
  maxContext: number;
  weightDtype: string;
  kvDtype: string;
  weightBytes: number;
  cpuNodes: number;
  tokenizerKind: string;
  openSessions: number;
  chatTemplate: string;
  bosToken: string;
  eosToken: string;
  eosTokenIds: number[];
  [field: string]: unknown;
}

export declare class Client {
  constructor(address: string, options?: ClientOptions);
  readonly address: string;
  timeoutMs?: number;
  generate(prompt: Prompt, opts?: GenerateOptions): GenerateStream;
  complete(prompt: Prompt, opts?: GenerateOptions): Promise<Result>;
  tokenize(text: string, opts?: CallOptions & { addBos?: boolean }): Promise<number[]>;
  detokenize(tokenIds: number[], opts?: CallOptions): Promise<string>;
  modelInfo(opts?: CallOptions): Promise<ModelInfo>;
  session(sessionId: string): Session;
  withSession<T>(sessionId: string, fn: (session: Session) => Promise<T>): Promise<T>;
  closeSession(sessionId: string, opts?: CallOptions): Promise<void>;
  close(): void;
}

export declare class Session {
  constructor(client: Client, sessionId: string);
  readonly client: Client;
  readonly id: string;
  generate(prompt: Prompt, opts?: GenerateOptions): GenerateStream;
  complete(prompt: Prompt, opts?: GenerateOptions): Promise<Result>;
  close(opts?: CallOptions): Promise<void>;
}

export declare class TandemError extends Error {
  constructor(details: string, code?: number, metadata?: Metadata);
  /** The gRPC status code (grpc.status). */
  readonly code: number;
  /** Its name, e.g. "INVALID_ARGUMENT". */
  readonly codeName: string;
  /** The worker's message, naming the offending field. */
  readonly details: string;
  readonly metadata?: Metadata;
}
export declare class InvalidArgument extends TandemError {}
export declare class NotFound extends TandemError {}
export declare class FailedPrecondition extends TandemError {}
export declare class ResourceExhausted extends TandemError {}
export declare class Unavailable extends TandemError {}
export declare class Cancelled extends TandemError {}
export declare class DeadlineExceeded extends TandemError {}
export declare class Internal extends TandemError {}
