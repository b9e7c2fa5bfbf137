'use strict';
// The Node SDK (clients/node) against a real tandem-gpu-worker (cpu backend, stories260k, gpu
// mode: exact greedy), one worker for the file: greedy generation equals the model's golden
// continuation (../shared/models/stories260k/golden.json), tokenize, a two-turn session equal to
// the one-shot generation over the same ids, close then NotFound, refusals as typed errors naming
// the field, deadlines, an unreachable worker, cancellation by breaking the loop and by an
// AbortSignal (on a second worker, gutenberg-14m, whose context holds a long request), mode
// exact (the golden text with its split), capacity (a context that fits, one that does not, the
// largest context at its edge, bad options), and the README example run as written. Run through
// run.js (ctest clients.node).

const { describe, test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { spawnSync } = require('node:child_process');
const fs = require('node:fs');
const net = require('node:net');
const path = require('node:path');

const tandem = require('../../../clients/node');
const { startWorker } = require('./worker_process');

const SHARED_DIR = process.env.TANDEM_SHARED_DIR || path.resolve(__dirname, '../../../../shared');
const MODEL_DIR = path.join(SHARED_DIR, 'models', 'stories260k');
const GOLDEN = JSON.parse(fs.readFileSync(path.join(MODEL_DIR, 'golden.json'), 'utf8'));
const PROMPT = GOLDEN.prompt_text_equivalent;                           // "Once upon a time"
const PROMPT_IDS = GOLDEN.prompt_text_equivalent_ids;                   // its ids, BOS first
const CONTINUATION_IDS = GOLDEN.greedy_ids.slice(PROMPT_IDS.length);    // 56 greedy tokens
const CONTINUATION_TEXT = GOLDEN.greedy_text.slice(PROMPT.length);

let worker;
let client;

before(async () => {
  const binary = process.env.TANDEM_GPU_WORKER_BIN;
  assert.ok(binary && fs.existsSync(binary),
    `TANDEM_GPU_WORKER_BIN=${binary} is not a file (build the tandem-gpu-worker target)`);
  worker = await startWorker(binary, MODEL_DIR);
  client = new tandem.Client(worker.address, { timeoutMs: 60_000 });
});

after(() => {
  client?.close();
  worker?.stop();
});

test('greedy stream is the golden continuation', async () => {
  const events = [];
  for await (const event of client.generate(PROMPT, { maxTokens: CONTINUATION_IDS.length })) {
    events.push(event);
  }
  const prefills = events.filter((e) => e.type === 'prefill');
  const tokens = events.filter((e) => e.type === 'token');
  assert.ok(prefills.length > 0);
  assert.deepEqual([prefills.at(-1).processed, prefills.at(-1).total], [5, 5]);
  assert.deepEqual(tokens.map((t) => t.id), CONTINUATION_IDS);
  assert.deepEqual(tokens.map((t) => t.index), CONTINUATION_IDS.map((_, i) => i));
  assert.equal(tokens.map((t) => t.text).join(''), CONTINUATION_TEXT);
  assert.ok(tokens.every((t) => t.logprob === undefined && t.topLogprobs.length === 0));
  assert.deepEqual(tokens.map((t) => t.raw.tokenId), CONTINUATION_IDS);

  const final = events.at(-1);
  assert.equal(final.type, 'final');
  const r = final.result;
  assert.equal(r.text, CONTINUATION_TEXT);
  assert.deepEqual(r.tokenIds, CONTINUATION_IDS);
  assert.deepEqual(r.usage,
                   { promptTokens: 5, completionTokens: 56, totalTokens: 61, cachedTokens: 0 });
  assert.equal(r.finishReason, 'length');
  assert.equal(r.mode, 'gpu');
  assert.equal(r.sessionId, '');
  assert.equal(r.deviceKvEntries, 60);   // prompt + tokens fed back (not the last)
  assert.equal(r.degraded, false);
  assert.ok(r.timeToFirstTokenSeconds > 0);
  assert.ok(r.totalSeconds >= r.timeToFirstTokenSeconds);
});

test('complete from prompt ids, snake_case options, stop strings', async () => {
  const r = await client.complete(PROMPT_IDS, { max_tokens: CONTINUATION_IDS.length });
  assert.equal(r.text, CONTINUATION_TEXT);
  assert.equal(r.usage.promptTokens, PROMPT_IDS.length);
  const stopped = await client.complete(PROMPT, { maxTokens: 56, stop: 'Lily' });
  assert.equal(stopped.finishReason, 'stop');
  assert.equal(stopped.text, CONTINUATION_TEXT.slice(0, CONTINUATION_TEXT.indexOf('Lily')));
});

test('logprobs of greedy tokens', async () => {
  const r = await client.complete(PROMPT, { maxTokens: 8, logprobs: true, topLogprobs: 3 });
  assert.deepEqual(r.tokenIds, CONTINUATION_IDS.slice(0, 8));
  for (const token of r.tokens) {
    assert.equal(typeof token.logprob, 'number');
    assert.ok(token.logprob <= 0);
    assert.equal(token.topLogprobs.length, 3);
    // Greedy: the sampled token is the likeliest one.
    assert.equal(token.topLogprobs[0].id, token.id);
    assert.ok(Math.abs(token.topLogprobs[0].logprob - token.logprob) < 1e-5);
    const lps = token.topLogprobs.map((t) => t.logprob);
    assert.deepEqual(lps, [...lps].sort((a, b) => b - a));
    assert.equal(Buffer.from(token.topLogprobs[0].bytes).toString(), token.topLogprobs[0].text);
  }
});

test('tokenize, detokenize, model info', async () => {
  assert.deepEqual(await client.tokenize(PROMPT, { addBos: true }), PROMPT_IDS);
  assert.equal((await client.tokenize(PROMPT)).length, PROMPT_IDS.length - 1);
  assert.equal(await client.detokenize(PROMPT_IDS.slice(1)), PROMPT);
  const info = await client.modelInfo();
  assert.equal(info.modelType, 'llama');
  assert.equal(info.backend, 'cpu');
  assert.deepEqual([info.vocabSize, info.maxContext, info.numLayers], [512, 512, 5]);
  assert.deepEqual(info.eosTokenIds, [2]);   // config.json and generation_config.json
});

test('a session of two turns continues the KV', async () => {
  const [first, second] = await client.withSession('node-two-turns', async (session) => [
    await session.complete(PROMPT, { maxTokens: 8 }),
    await session.complete(' The end', { maxTokens: 8 }),
  ]);
  assert.equal(first.sessionId, 'node-two-turns');
  assert.deepEqual(first.tokenIds, CONTINUATION_IDS.slice(0, 8));
  const secondPrompt = await client.tokenize(' The end');   // a continued turn gets no BOS
  assert.equal(second.usage.promptTokens, secondPrompt.length);
  // The second turn continues exactly as one request over all the ids would.
  const oneShot = await client.complete([...PROMPT_IDS, ...first.tokenIds, ...secondPrompt], { maxTokens: 8 });
  assert.deepEqual(second.tokenIds, oneShot.tokenIds);
  assert.equal(second.deviceKvEntries, first.usage.totalTokens + second.usage.totalTokens - 1);
  // withSession closed it.
  await assert.rejects(client.closeSession('node-two-turns'), tandem.NotFound);
});

test('close then NotFound', async () => {
  const session = client.session('node-close');
  await session.complete(PROMPT, { maxTokens: 2 });
  await session.close();
  await assert.rejects(session.close(), (err) => {
    assert.ok(err instanceof tandem.NotFound);
    assert.ok(err instanceof tandem.TandemError);
    assert.equal(err.code, 5);
    assert.equal(err.codeName, 'NOT_FOUND');
    assert.match(err.details, /node-close/);
    return true;
  });
});

test('invalid requests are InvalidArgument naming the field; the worker keeps serving', async () => {
  const cases = [
    [{ maxTokens: 0 }, /max_tokens/],
    [{ maxTokens: 4, temperature: -1 }, /temperature/],
    [{ maxTokens: 4, topLogprobs: 2 }, /logprobs/],
    [{ maxTokens: 4, sessionId: 'not a valid id!' }, /session_id/],
  ];
  for (const [opts, field] of cases) {
    await assert.rejects(client.complete(PROMPT, opts), (err) => {
      assert.ok(err instanceof tandem.InvalidArgument, `${JSON.stringify(opts)}: ${err}`);
      assert.equal(err.code, 3);
      assert.match(err.details, field);
      return true;
    });
  }
  await assert.rejects(client.detokenize([9999]), tandem.InvalidArgument);
  assert.deepEqual((await client.complete(PROMPT, { maxTokens: 3 })).tokenIds, CONTINUATION_IDS.slice(0, 3));
});

test('bad arguments are refused before sending', () => {
  assert.throws(() => client.generate(PROMPT, { maxToken: 4 }), { name: 'TypeError', message: /maxToken/ });
  assert.throws(() => client.generate(42, { maxTokens: 4 }), { name: 'TypeError', message: /prompt/ });
  assert.throws(() => client.generate(PROMPT, { maxTokens: 4, temperature: 'hot' }),
    { name: 'TypeError', message: /temperature/ });
});

test('deadline exceeded', async () => {
  await assert.rejects(client.complete(PROMPT, { maxTokens: 4, timeoutMs: 0 }), tandem.DeadlineExceeded);
});

test('an unreachable worker is Unavailable', async () => {
  const port = await new Promise((resolve) => {   // a port nobody listens on
    const server = net.createServer().listen(0, '127.0.0.1', () => {
      const { port: p } = server.address();
      server.close(() => resolve(p));
    });
  });
  const nowhere = new tandem.Client(`127.0.0.1:${port}`, { timeoutMs: 5000 });
  try {
    await assert.rejects(nowhere.tokenize(PROMPT), tandem.Unavailable);
  } finally {
    nowhere.close();
  }
});

// Cancellation runs on gutenberg-14m (a second worker; skipped without the model): its
// 8192-token context lets a request ask for 8000 tokens, all the context but the prompt, which
// the worker would fill if it did not stop after the current token once the call is cancelled.
// Hybrid attention (window 16, the rest on the worker's embedded CPU node, exact with maw and
// beta 0) costs milliseconds a token there, so the whole 8000 would take far longer (tens of
// seconds) than the cancel takes to arrive, even on a loaded CI machine. (stories260k's 512
// positions left ~0.5 s of generation to race the cancel.)
const LONG = 8000;
const LONG_PROMPT = 'It was a dark and stormy night';
const LONG_MODEL_DIR = path.join(SHARED_DIR, 'models', 'gutenberg-14m');
const HYBRID = { mode: 'hybrid', window: 16, sink: 4, selection: 'maw', beta: 0 };

describe('cancellation', {
  skip: !fs.existsSync(path.join(LONG_MODEL_DIR, 'config.json')) &&
    `no gutenberg-14m model at ${LONG_MODEL_DIR}`,
}, () => {
  let longWorker;
  let longClient;
  let hybridIds;      // the greedy tokens the cancelled hybrid calls start with
  let promptTokens;   // LONG_PROMPT's length in tokens

  before(async () => {
    longWorker = await startWorker(process.env.TANDEM_GPU_WORKER_BIN, LONG_MODEL_DIR);
    longClient = new tandem.Client(longWorker.address, { timeoutMs: 60_000 });
    const reference = await longClient.complete(LONG_PROMPT, { maxTokens: 3, ...HYBRID });
    hybridIds = reference.tokenIds;
    promptTokens = reference.usage.promptTokens;
  });

  after(() => {
    longClient?.close();
    longWorker?.stop();
  });

  // Tokens the cancelled turn generated, read from the next turn's KV size.
  async function generatedBeforeCancel(session) {
    const next = await session.complete(' The end', { maxTokens: 1 });
    assert.equal(next.mode, 'hybrid');
    const positions = next.deviceKvEntries + next.cpuKvEntries;
    return positions - promptTokens - next.usage.totalTokens + 1;
  }

  test('breaking the loop cancels the call', async () => {
    const session = longClient.session('node-cancel-break');
    const seen = [];
    const stream = session.generate(LONG_PROMPT, { maxTokens: LONG, ignoreEos: true, ...HYBRID });
    for await (const event of stream) {
      if (event.type === 'token') {
        seen.push(event.id);
        if (seen.length === 3) break;
      }
    }
    assert.deepEqual(seen, hybridIds);
    assert.equal(stream.cancelled, true);
    const generated = await generatedBeforeCancel(session);
    assert.ok(generated >= 3 && generated < LONG, `generated ${generated}`);
    await session.close();
  });

  test('an AbortSignal cancels the call; the loop throws Cancelled', async () => {
    const session = longClient.session('node-cancel-signal');
    const controller = new AbortController();
    let seen = 0;
    await assert.rejects(async () => {
      for await (const event of session.generate(LONG_PROMPT, { maxTokens: LONG, ignoreEos: true, signal: controller.signal, ...HYBRID })) {
        if (event.type === 'token' && ++seen === 2) controller.abort();
      }
    }, (err) => {
      assert.ok(err instanceof tandem.Cancelled, String(err));
      assert.equal(err.codeName, 'CANCELLED');
      return true;
    });
    assert.equal(seen, 2);   // nothing buffered is yielded after the abort
    const generated = await generatedBeforeCancel(session);
    assert.ok(generated >= 2 && generated < LONG, `generated ${generated}`);
    await session.close();
  });
});

test('mode exact: the golden continuation with its split; no split in gpu mode', async () => {
  // A 32-token window: most of the 60 positions leave the device and are attended exactly from
  // host pages (a toy model's planned split is all-fetch).
  const result = await client.complete(PROMPT, { maxTokens: CONTINUATION_IDS.length, mode: 'exact',
    window: 32, sink: 4 });
  assert.equal(result.mode, 'exact');
  assert.equal(result.text, CONTINUATION_TEXT);
  const split = result.exactSplit;
  assert.ok(split, 'exactSplit is set in mode exact');
  assert.ok(Math.abs(split.fetchShare + split.nodeShare + split.recomputeShare - 1) < 1e-6);
  assert.ok(split.hostEntries + split.nodeEntries > 0);
  assert.ok(result.deviceKvEntries < 60);
  assert.ok(split.modelledStepSeconds > 0);
  assert.equal(typeof split.recomputePays, 'boolean');
  assert.ok(split.recomputeReason.length > 0);

  const gpu = await client.complete(PROMPT, { maxTokens: 4 });
  assert.equal(gpu.mode, 'gpu');
  assert.equal(gpu.exactSplit, undefined);
  await assert.rejects(client.complete(PROMPT, { maxTokens: 4, mode: 'exact', beta: 0 }),
    (err) => err instanceof tandem.InvalidArgument && /mode exact/.test(err.details));
});

// Hybrid with a 64-token window: 256 sequences of 512 positions need ~150 MiB of node KV, more
// than the worker's 64 MiB embedded pool.
const CAPACITY_HYBRID = { mode: 'hybrid', window: 64, sink: 4, batch: 256 };

test('capacity: a small context fits', async () => {
  const plan = await client.capacity({ context: 256 });
  assert.deepEqual([plan.context, plan.prompt, plan.batch, plan.mode], [256, 256, 1, 'gpu']);
  assert.ok(plan.fits && plan.device.fits && plan.host.fits && plan.nodes.fits);
  assert.equal(plan.why, '');
  assert.equal(plan.largestContext, 512);   // stories260k's max_context
  const weights = plan.device.items.find((i) => i.name === 'weights');
  assert.equal(weights.bytes, 1040128);     // 260K f32 parameters
  assert.equal(plan.device.items.reduce((sum, i) => sum + i.bytes, 0), plan.device.totalBytes);
  assert.ok(plan.device.totalBytes <= plan.device.capacityBytes);
  assert.match(plan.text, /largest context that fits/);
});

test('capacity: a large batch does not fit; the largest context does, one more does not', async () => {
  const plan = await client.capacity({ context: 512, ...CAPACITY_HYBRID });
  assert.equal(plan.fits, false);
  assert.equal(plan.nodes.fits, false);
  assert.equal(plan.device.fits, true);
  assert.match(plan.nodes.why, /in-process/);
  assert.equal(plan.why, plan.nodes.why);
  assert.equal(plan.nodes.capacityBytes, 64 * 1024 * 1024);
  assert.ok(plan.nodes.totalBytes > plan.nodes.capacityBytes);
  assert.equal(plan.nodeBytes.length, plan.nodeAddresses.length);
  assert.ok(plan.largestContext > 68 && plan.largestContext < 512, `${plan.largestContext}`);
  assert.equal((await client.capacity({ ...CAPACITY_HYBRID, context: plan.largestContext })).fits, true);
  assert.equal((await client.capacity({ ...CAPACITY_HYBRID, context: plan.largestContext + 1 })).fits,
    false);
});

test('capacity: bad arguments', async () => {
  await assert.rejects(client.capacity({ context: 513 }),
    (err) => err instanceof tandem.InvalidArgument && /context must be in 1\.\.512/.test(err.details));
  await assert.rejects(client.capacity({ context: 64, mode: 'fast' }), tandem.InvalidArgument);
  // Refused before sending (a rejection: capacity() is async, as tokenize()).
  await assert.rejects(client.capacity({ contxt: 64 }), { name: 'TypeError', message: /contxt/ });
  await assert.rejects(client.capacity({ window: 'wide' }), { name: 'TypeError', message: /window/ });
  // snake_case works as in generate().
  assert.equal((await client.capacity({ context: 64, select_tokens: 16, mode: 'hybrid' })).context, 64);
});

test('the README example runs as written', () => {
  const example = path.resolve(__dirname, '../../../clients/node/examples/example.mjs');
  const r = spawnSync(process.execPath, [example, worker.address], { encoding: 'utf8', timeout: 60_000 });
  assert.equal(r.status, 0, r.stderr);
  assert.match(r.stdout, /^32 tokens, finish: length, TTFT/m);
  assert.match(r.stdout, /\[ 1, 403, 407, 261, 378 \]/);
  assert.match(r.stdout, /^true 512 weights, /m);
  assert.match(r.stdout, /^exact 1 \d+$/m);
  assert.match(r.stdout, /^CANCELLED$/m);
  assert.match(r.stdout, /^INVALID_ARGUMENT max_tokens must be in 1\.\.512, got 0$/m);
});
