// The README's example: node clients/node/examples/example.mjs [host:port]. Type-checked
// against index.d.ts by `tsc -p clients/node` (ctest clients.node.types).
// (with clients/node/node_modules installed: scripts/setup.sh or `npm ci` in clients/node).
import { Cancelled, Client, InvalidArgument } from '../index.js';

const client = new Client(process.argv[2] ?? '127.0.0.1:50051', { timeoutMs: 60_000 });
try {
  // Streaming: prefill events, one token event per generated token, then the final event.
  for await (const event of client.generate('Once upon a time', { maxTokens: 32, temperature: 0.7, seed: 1 })) {
    if (event.type === 'token') process.stdout.write(event.text);
    else if (event.type === 'final') {
      const r = event.result;
      console.log(`\n${r.usage.completionTokens} tokens, finish: ${r.finishReason}, ` +
        `TTFT ${(r.timeToFirstTokenSeconds * 1e3).toFixed(1)} ms`);
    }
  }

  // The whole text at once, with log-probabilities.
  const result = await client.complete('Once upon a time', { maxTokens: 8, logprobs: true, topLogprobs: 2 });
  console.log(result.text, result.tokens.map((t) => t.logprob?.toFixed(3)));

  console.log(await client.tokenize('Once upon a time', { addBos: true }));   // [ 1, 403, 407, 261, 378 ]
  console.log((await client.modelInfo()).maxContext);

  // The worker's memory plan of 4 sequences of 256 positions: per tier, fits, the largest context.
  const plan = await client.capacity({ context: 256, batch: 4 });
  console.log(plan.fits, plan.largestContext, plan.device.items.map((i) => i.name).join(', '));
  // true 512 weights, activations, kv (all on the device)

  // mode "exact": attention over every position; the result says where the offloaded KV went.
  const exact = await client.complete('Once upon a time', { maxTokens: 56, mode: 'exact', window: 32 });
  console.log(exact.mode, exact.exactSplit?.fetchShare, exact.exactSplit?.hostEntries);   // exact 1 32

  // A kept session: each turn continues the KV of the earlier ones; closed when fn returns.
  await client.withSession('chat-42', async (session) => {
    await session.complete('Once upon a time', { maxTokens: 16 });
    console.log((await session.complete(' The next day', { maxTokens: 16 })).text);
  });

  // Cancellation: an AbortSignal (or leaving the loop early) stops the worker.
  const controller = new AbortController();
  try {
    for await (const event of client.generate('Once upon a time', { maxTokens: 400, signal: controller.signal })) {
      if (event.type === 'token' && event.index === 2) controller.abort();
    }
  } catch (err) {
    if (!(err instanceof Cancelled)) throw err;
    console.log(err.codeName);   // CANCELLED
  }

  try {
    await client.complete('Once upon a time', { maxTokens: 0 });
  } catch (err) {
    if (!(err instanceof InvalidArgument)) throw err;
    console.log(err.codeName, err.details);   // INVALID_ARGUMENT max_tokens must be in 1..512, got 0
  }
} finally {
  client.close();
}
