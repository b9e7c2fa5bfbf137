'use strict';
// The events a Generate stream yields (plain objects with a `type`), converted from the
// decoded GenerateResponse messages. Each keeps its message in `raw`, which also carries any
// field added to the proto later.

// FINISH_REASON_LENGTH -> 'length' (an enum value added to the proto later keeps its name).
const finishReason = (name) =>
  typeof name === 'string' ? name.replace(/^FINISH_REASON_/, '').toLowerCase() : String(name);

function prefillEvent(msg) {
  return { type: 'prefill', total: msg.total, processed: msg.processed,
    elapsedSeconds: msg.elapsedSeconds, raw: msg };
}

function tokenEvent(msg) {
  return {
    type: 'token',
    id: msg.tokenId,
    text: msg.text,
    index: msg.index,
    // Set only when the request asked for logprobs (a proto3 optional: absent otherwise).
    logprob: msg.logprob ?? undefined,
    topLogprobs: (msg.topLogprobs ?? []).map((t) =>
      ({ id: t.tokenId, text: t.text, bytes: t.raw, logprob: t.logprob })),
    raw: msg,
  };
}

// The final message plus what the client gathered from the token events.
function resultOf(final, tokens) {
  return {
    text: tokens.map((t) => t.text).join(''),
    tokenIds: tokens.map((t) => t.id),
    tokens,
    usage: { ...final.usage },
    finishReason: finishReason(final.finishReason),
    timeToFirstTokenSeconds: final.timeToFirstTokenSeconds,
    meanTokenLatencySeconds: final.meanTokenLatencySeconds,
    p50TokenLatencySeconds: final.p50TokenLatencySeconds,
    p99TokenLatencySeconds: final.p99TokenLatencySeconds,
    totalSeconds: final.totalSeconds,
    degraded: final.degraded,
    degradedSteps: final.degradedSteps,
    deviceKvEntries: final.deviceKvEntries,
    cpuKvEntries: final.cpuKvEntries,
    sessionId: final.sessionId,
    mode: final.mode,
    // Mode "exact" only: how the offloaded KV was split (an unset message decodes to null).
    exactSplit: final.exactSplit ? { ...final.exactSplit } : undefined,
    raw: final,
  };
}

module.exports = { prefillEvent, tokenEvent, resultOf };
