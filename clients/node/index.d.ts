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
  /** "gpu" | "hybrid" | "offload" | "exact"; default the worker's --mode. */
  mode?: Mode | string;
  beta?: number;
  window?: number;
  sink?: number;
  /** "pages" | "maw". */
  selection?: string;
  selectTokens?: number;
  denseLayers?: number;
  /** Continue (or create) this kept session. */
  sessionId?: string;
  /** Prefix-cache scope beside the caller's credentials: only equal salts share cached KV. */
  cacheSalt?: string;
  /** Aborting cancels the call; the loop then throws Cancelled. */
  signal?: AbortSignal;
  /** A GenerateRequest field added to the proto later (camelCase or snake_case). */
  [field: string]: unknown;
}

export type Prompt = string | number[];

export type Mode = 'gpu' | 'hybrid' | 'offload' | 'exact';

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
  /** Of promptTokens, those the worker's prefix cache served (not prefilled). */
  cachedTokens: number;
}

/**
 * Mode "exact": how a session's offloaded KV was split between the paths that attend it
 * exactly (the planner's choice or the worker's --exact_fetch_share). Shares are fractions of
 * the offloaded entries and sum to 1.
 */
export interface ExactSplit {
  /** Pinned host pages streamed over PCIe. */
  fetchShare: number;
  /** On the CPU nodes, attended densely there. */
  nodeShare: number;
  /** Recomputed from stored activations (KVPR). */
  recomputeShare: number;
  /** Per decode step, all layers, this split. */
  modelledStepSeconds: number;
  /** The same step with every entry fetched. */
  modelledFetchOnlySeconds: number;
  /** Whether recompute would lower the modelled step, and why (in words). */
  recomputePays: boolean;
  recomputeReason: string;
  /** Per (layer, kv head) at the end: in host pages / on the CPU nodes. */
  hostEntries: number;
  nodeEntries: number;
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
  /** The mode that ran. */
  mode: Mode | string;
  /** Set only when the mode that ran is "exact". */
  exactSplit?: ExactSplit;
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

/** GetCapacityRequest's fields (see generation.proto); unset = the worker's defaults. */
export interface CapacityOptions extends CallOptions {
  /** Positions per sequence (prompt + generated, all turns); 0 = the worker's max_context. */
  context?: number;
  /** Of those, the prompt; 0 = all of the context. */
  prompt?: number;
  /** Sequences held at once, 1..4096; 0 = 1. */
  batch?: number;
  mode?: Mode | string;
  window?: number;
  sink?: number;
  selection?: string;
  selectTokens?: number;
  beta?: number;
}

/** One part of an estimate, e.g. "weights", "kv windows", "node KV blocks". */
export interface CapacityItem {
  name: string;
  bytes: number;
  /** How it is made up, for people. */
  detail: string;
}

/** One kind of memory: the device (RAM for the cpu backend), the worker's host RAM, or the CPU
 * nodes' pools together. */
export interface CapacityTier {
  items: CapacityItem[];
  /** Sum of the items. */
  totalBytes: number;
  /** What there is. */
  capacityBytes: number;
  fits: boolean;
  /** When it does not fit: what is short; "" otherwise. */
  why: string;
}

/** A worker's GetCapacity answer. */
export interface Capacity {
  /** The request as sized (defaults filled in). */
  context: number;
  prompt: number;
  batch: number;
  mode: Mode | string;
  device: CapacityTier;
  host: CapacityTier;
  nodes: CapacityTier;
  /** Projected bytes per CPU node, in nodeAddresses' order. */
  nodeBytes: number[];
  nodeAddresses: string[];
  /** Every tier fits. */
  fits: boolean;
  /** The short tiers' reasons joined ("" when it fits). */
  why: string;
  /** The largest context that fits with this batch, mode and generated tokens; 0: none. */
  largestContext: number;
  /** The estimate as a table for people (what `tandem capacity` prints). */
  text: string;
  raw: Record<string, unknown>;
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
  /** The worker's memory plan of a request (GetCapacity). */
  capacity(opts?: CapacityOptions): Promise<Capacity>;
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
