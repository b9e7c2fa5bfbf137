'use strict';
// GenerateRequest from JS arguments: the prompt plus options named as the proto's fields, in
// camelCase (maxTokens) or the proto's snake_case (max_tokens). Options are checked against the
// loaded GenerateRequest descriptor, so a field added to generation.proto is an option at once;
// an unknown name or a value of the wrong JS type is a TypeError before anything is sent.

const { messageFields } = require('./proto');

// Options of generate() itself, not GenerateRequest fields.
const CALL_OPTIONS = new Set(['sessionId', 'timeoutMs', 'signal', 'metadata']);
// Set from generate()'s prompt argument.
const PROMPT_FIELDS = new Set(['promptText', 'promptIds', 'sessionId']);

const NUMERIC = new Set(['TYPE_FLOAT', 'TYPE_DOUBLE', 'TYPE_INT32', 'TYPE_INT64', 'TYPE_UINT32',
  'TYPE_UINT64', 'TYPE_SINT32', 'TYPE_SINT64', 'TYPE_FIXED32', 'TYPE_FIXED64', 'TYPE_SFIXED32',
  'TYPE_SFIXED64']);
const WIDE = new Set(['TYPE_INT64', 'TYPE_UINT64', 'TYPE_SINT64', 'TYPE_FIXED64',
  'TYPE_SFIXED64']);

const camel = (name) => name.replace(/_([a-z0-9])/g, (_, c) => c.toUpperCase());

// kind names the call in messages ('generate', 'capacity').
function checkScalar(name, type, value, kind = 'generate') {
  if (NUMERIC.has(type)) {
    // 64-bit fields also take a bigint or a decimal string (a seed above 2^53).
    const ok = typeof value === 'number' ||
      (WIDE.has(type) && (typeof value === 'bigint' || /^[0-9]+$/.test(String(value))));
    if (!ok) throw new TypeError(`${kind} option '${name}' must be a number, got ${typeof value}`);
    return typeof value === 'bigint' ? value.toString() : value;
  }
  if (type === 'TYPE_BOOL' && typeof value !== 'boolean') {
    throw new TypeError(`${kind} option '${name}' must be a boolean, got ${typeof value}`);
  }
  if (type === 'TYPE_STRING' && typeof value !== 'string') {
    throw new TypeError(`${kind} option '${name}' must be a string, got ${typeof value}`);
  }
  return value;
}

// Returns a plain GenerateRequest object for grpc-js. prompt: text (string) or token ids (an
// array of ints, fed as given: no BOS added). opts: GenerateRequest fields plus the call options
// (sessionId, timeoutMs, signal, metadata); undefined or null leaves a field unset.
function buildGenerateRequest(definition, prompt, opts = {}) {
  const request = {};
  if (typeof prompt === 'string') {
    request.promptText = prompt;
  } else if (Array.isArray(prompt)) {
    if (!prompt.every(Number.isInteger)) throw new TypeError('prompt token ids must be integers');
    request.promptIds = { ids: prompt };
  } else {
    throw new TypeError(`prompt must be text (a string) or token ids (an array of integers), got ${typeof prompt}`);
  }
  if (opts.sessionId !== undefined && opts.sessionId !== null) {
    if (typeof opts.sessionId !== 'string') throw new TypeError('sessionId must be a string');
    request.sessionId = opts.sessionId;
  }

  const fields = new Map(messageFields(definition, 'GenerateRequest').map((f) => [f.name, f]));
  for (const [key, value] of Object.entries(opts)) {
    const name = camel(key);
    if (CALL_OPTIONS.has(name)) continue;
    const field = fields.get(name);
    if (!field || PROMPT_FIELDS.has(name)) {
      const known = [...fields.keys()].filter((f) => !PROMPT_FIELDS.has(f)).sort().join(', ');
      throw new TypeError(`unknown generate option '${key}' (GenerateRequest has: ${known})`);
    }
    if (value === undefined || value === null) continue;
    if (field.label === 'LABEL_REPEATED') {
      const list = Array.isArray(value) ? value : [value];
      request[name] = list.map((v) => checkScalar(key, field.type, v));
    } else if (field.type === 'TYPE_MESSAGE') {
      request[name] = value;
    } else {
      request[name] = checkScalar(key, field.type, value);
    }
  }
  return request;
}

module.exports = { buildGenerateRequest, checkScalar, camel, CALL_OPTIONS };
