'use strict';
// GetCapacity: the memory plan of a request on one worker. The request is built from options
// named as GetCapacityRequest's fields (camelCase or snake_case, checked against the loaded
// descriptor); the response becomes a plain object with one tier each for the device (RAM for
// the cpu backend), the worker's host RAM and the CPU nodes' pools.

const { messageFields } = require('./proto');
const { checkScalar, camel, CALL_OPTIONS } = require('./request');

// Returns a plain GetCapacityRequest for grpc-js; undefined or null leaves a field unset (the
// worker's default). Throws TypeError for an unknown option or a value of the wrong JS type.
function buildCapacityRequest(definition, opts = {}) {
  if (opts === null || typeof opts !== 'object') {
    throw new TypeError('capacity options must be an object, e.g. { context: 4096, batch: 8 }');
  }
  const fields = new Map(messageFields(definition, 'GetCapacityRequest').map((f) => [f.name, f]));
  const request = {};
  for (const [key, value] of Object.entries(opts)) {
    const name = camel(key);
    if (CALL_OPTIONS.has(name)) continue;
    const field = fields.get(name);
    if (!field) {
      const known = [...fields.keys()].sort().join(', ');
      throw new TypeError(`unknown capacity option '${key}' (GetCapacityRequest has: ${known})`);
    }
    if (value === undefined || value === null) continue;
    request[name] = checkScalar(key, field.type, value, 'capacity');
  }
  return request;
}

// A CapacityTier message (null when unset) as { items: [{ name, bytes, detail }], totalBytes,
// capacityBytes, fits, why }.
function tierOf(tier) {
  const t = tier ?? {};
  return {
    items: (t.items ?? []).map((i) => ({ name: i.name, bytes: i.bytes, detail: i.detail })),
    totalBytes: t.totalBytes ?? 0,
    capacityBytes: t.capacityBytes ?? 0,
    fits: Boolean(t.fits),
    why: t.why ?? '',
  };
}

function capacityOf(msg) {
  const device = tierOf(msg.device);
  const host = tierOf(msg.host);
  const nodes = tierOf(msg.nodes);
  return {
    context: msg.context,
    prompt: msg.prompt,
    batch: msg.batch,
    mode: msg.mode,
    device,
    host,
    nodes,
    nodeBytes: [...(msg.nodeBytes ?? [])],
    nodeAddresses: [...(msg.nodeAddresses ?? [])],
    fits: msg.fits,
    // What is short, tier by tier ('' when it fits).
    why: [device, host, nodes].map((t) => t.why).filter(Boolean).join('; '),
    largestContext: msg.largestContext,
    text: msg.text,
    raw: msg,
  };
}

module.exports = { buildCapacityRequest, capacityOf };
