// The npm `openai` client (pinned in package-lock.json) against a running tandem-gateway: chat
// and completions, streamed and not, greedy; the streamed text must equal the non-streamed one,
// usage must be the worker's counts, logprobs must have OpenAI's chat shape, and n=2 must raise
// openai.BadRequestError. Run by tests/gateway/openai/gateway_e2e_test.cc with:
//   GATEWAY_URL          http://127.0.0.1:PORT
//   EXPECTED_COMPLETION  the greedy continuation of "Once upon a time" (40 tokens, golden.json)
//   CHAT_PROMPT_TOKENS   tokens of the rendered chat prompt
// Prints "ALL OK" and exits 0 on success; an assertion failure exits 1 with its message.
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const client = new OpenAI({
  baseURL: `${process.env.GATEWAY_URL}/v1`,
  apiKey: 'unused',
  maxRetries: 0,
  timeout: 60_000,
});

const models = [];
for await (const m of client.models.list()) models.push(m);
assert.equal(models.length, 1);
const model = models[0].id;
assert.equal(model, 'stories260k');

// Completions.
const prompt = 'Once upon a time';
const whole = await client.completions.create({ model, prompt, max_tokens: 40, temperature: 0 });
assert.equal(whole.object, 'text_completion');
assert.equal(whole.choices[0].text, process.env.EXPECTED_COMPLETION);
assert.equal(whole.choices[0].finish_reason, 'length');
assert.deepEqual(whole.usage, {
  prompt_tokens: 5, completion_tokens: 40, total_tokens: 45,
  prompt_tokens_details: { cached_tokens: 0 },  // shorter than a cacheable prefix
  degraded_steps: 0,  // tandem's: every step had its CPU nodes' answers
});
assert.deepEqual(whole.tandem, { degraded: false, degraded_steps: 0, mode: 'hybrid' });

let streamed = '';
let usage = null;
let finish = null;
const stream = await client.completions.create({
  model, prompt, max_tokens: 40, temperature: 0, stream: true,
  stream_options: { include_usage: true },
});
for await (const chunk of stream) {
  if (chunk.usage) usage = chunk.usage;
  if (chunk.choices.length > 0) {
    streamed += chunk.choices[0].text;
    finish = chunk.choices[0].finish_reason ?? finish;
  }
}
assert.equal(streamed, whole.choices[0].text);
assert.equal(finish, 'length');
assert.deepEqual(usage, whole.usage);

// Chat.
const messages = [{ role: 'user', content: 'Once upon a time' }];
const chat = await client.chat.completions.create({ model, messages, max_tokens: 24, temperature: 0 });
assert.equal(chat.object, 'chat.completion');
assert.equal(chat.choices[0].message.role, 'assistant');
assert.ok(chat.choices[0].message.content.length > 0);
assert.equal(chat.usage.prompt_tokens, Number(process.env.CHAT_PROMPT_TOKENS));
assert.equal(chat.usage.total_tokens, chat.usage.prompt_tokens + chat.usage.completion_tokens);

let chatStreamed = '';
let chatUsage = null;
let role = null;
const chatStream = await client.chat.completions.create({
  model, messages, max_tokens: 24, temperature: 0, stream: true,
  stream_options: { include_usage: true },
});
for await (const chunk of chatStream) {
  if (chunk.usage) chatUsage = chunk.usage;
  if (chunk.choices.length > 0) {
    role = chunk.choices[0].delta.role ?? role;
    chatStreamed += chunk.choices[0].delta.content ?? '';
  }
}
assert.equal(role, 'assistant');
assert.equal(chatStreamed, chat.choices[0].message.content);
// The same conversation again: the prefix cache serves all of its prompt but the last token.
assert.equal(chat.usage.prompt_tokens_details.cached_tokens, 0);
assert.equal(chatUsage.prompt_tokens_details.cached_tokens, chat.usage.prompt_tokens - 1);
assert.deepEqual({ ...chatUsage, prompt_tokens_details: undefined },
                 { ...chat.usage, prompt_tokens_details: undefined });

// Chat logprobs: one entry per token; greedy picks the most likely token.
const withLogprobs = await client.chat.completions.create({
  model, messages, max_tokens: 8, temperature: 0, logprobs: true, top_logprobs: 2,
});
const content = withLogprobs.choices[0].logprobs.content;
assert.equal(content.length, withLogprobs.usage.completion_tokens);
for (const entry of content) {
  assert.equal(typeof entry.token, 'string');
  assert.ok(entry.logprob <= 0);
  assert.ok(Array.isArray(entry.bytes));
  assert.equal(entry.top_logprobs.length, 2);
  assert.ok(Math.abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6);
  assert.ok(entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob);
}

// Errors surface as the client's typed exceptions.
await assert.rejects(
  client.chat.completions.create({ model, messages, max_tokens: 4, n: 2 }),
  (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && /'n' must be 1/.test(e.message));
await assert.rejects(
  client.completions.create({ model: 'no-such-model', prompt, max_tokens: 4 }),
  (e) => e instanceof OpenAI.NotFoundError && e.status === 404);

console.log('ALL OK');
