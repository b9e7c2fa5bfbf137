// The Responses API (POST /v1/responses) with the npm `openai` client's responses.create and the
// Vercel AI SDK's default provider (`openai(model)` speaks the Responses API), against a running
// tandem-gateway: the answer equals chat completions' for the same conversation (greedy),
// streamed equals whole, previous_response_id continues the stored conversation and the prefix
// cache serves its prompt, retrieve and delete work, unknown ids are 404. Run by
// tests/gateway/openai/gateway_e2e_test.cc with:
//   GATEWAY_URL          http://127.0.0.1:PORT
//   CHAT_PROMPT_TOKENS   tokens of the rendered chat prompt of one user message
// Prints "ALL OK" and exits 0 on success; an assertion failure exits 1 with its message.
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { createOpenAI } from '@ai-sdk/openai';
import { generateText, streamText } from 'ai';

const baseURL = `${process.env.GATEWAY_URL}/v1`;
const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
const model = 'stories260k';
const text = 'Once upon a time';

// The reference: chat completions over the same one-message conversation.
const chat = await client.chat.completions.create({
  model, messages: [{ role: 'user', content: text }], max_tokens: 24, temperature: 0,
});
const expected = chat.choices[0].message.content;
assert.ok(expected.length > 0);

// openai: whole.
const first = await client.responses.create({
  model, input: text, max_output_tokens: 24, temperature: 0, metadata: { case: 'first' },
});
assert.equal(first.object, 'response');
assert.match(first.id, /^resp_[0-9a-f]{48}$/);
assert.equal(first.output_text, expected);
assert.equal(first.status, 'incomplete');   // stopped by max_output_tokens
assert.deepEqual(first.incomplete_details, { reason: 'max_output_tokens' });
assert.equal(first.output[0].type, 'message');
assert.equal(first.output[0].role, 'assistant');
assert.equal(first.usage.input_tokens, Number(process.env.CHAT_PROMPT_TOKENS));
assert.equal(first.usage.output_tokens, 24);
assert.equal(first.usage.total_tokens, first.usage.input_tokens + 24);
assert.deepEqual(first.metadata, { case: 'first' });
assert.equal(first.tandem.degraded, false);

// openai: streamed, the same text; the events' order and the final response.
const events = [];
let streamed = '';
const stream = await client.responses.create({
  model, input: [{ role: 'user', content: [{ type: 'input_text', text }] }],
  max_output_tokens: 24, temperature: 0, stream: true,
});
for await (const event of stream) {
  events.push(event.type);
  if (event.type === 'response.output_text.delta') streamed += event.delta;
  if (event.type === 'response.incomplete') {
    assert.equal(event.response.output[0].content[0].text, expected);
  }
}
assert.equal(streamed, expected);
assert.deepEqual(events.slice(0, 4), ['response.created', 'response.in_progress',
                                      'response.output_item.added',
                                      'response.content_part.added']);
assert.equal(events.at(-1), 'response.incomplete');

// previous_response_id: the next turn's prompt starts with the stored conversation, so the
// prefix cache serves most of it.
const second = await client.responses.create({
  model, previous_response_id: first.id, input: 'Then what happened?', max_output_tokens: 8,
  temperature: 0,
});
assert.equal(second.previous_response_id, first.id);
assert.ok(second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens,
          JSON.stringify(second.usage));
assert.ok(second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens,
          JSON.stringify(second.usage));
// The same conversation sent whole through chat completions gives the same answer.
const resent = await client.chat.completions.create({
  model, max_tokens: 8, temperature: 0,
  messages: [{ role: 'user', content: text }, { role: 'assistant', content: expected },
             { role: 'user', content: 'Then what happened?' }],
});
assert.equal(second.output_text, resent.choices[0].message.content);
assert.equal(second.usage.input_tokens, resent.usage.prompt_tokens);

// retrieve and delete; store: false keeps nothing.
const retrieved = await client.responses.retrieve(first.id);
assert.equal(retrieved.output_text, expected);
assert.equal(retrieved.id, first.id);
const deleted = await client.responses.delete(first.id);
await assert.rejects(client.responses.retrieve(first.id),
                     (e) => e instanceof OpenAI.NotFoundError && e.status === 404);
const unstored = await client.responses.create({
  model, input: text, max_output_tokens: 4, temperature: 0, store: false,
});
await assert.rejects(client.responses.retrieve(unstored.id),
                     (e) => e instanceof OpenAI.NotFoundError);
await assert.rejects(
  client.responses.create({ model, input: 'x', previous_response_id: 'resp_nope' }),
  (e) => e instanceof OpenAI.NotFoundError && /resp_nope/.test(e.message));
await assert.rejects(
  client.responses.create({ model, input: 'x', tools: [{ type: 'function', name: 'f',
                                                         parameters: {} }] }),
  (e) => e instanceof OpenAI.BadRequestError && e.status === 400);
void deleted;

// The Vercel AI SDK's default provider: generateText and streamText.
const openai = createOpenAI({ baseURL, apiKey: 'unused' });
const generated = await generateText({
  model: openai(model), prompt: text, maxOutputTokens: 24, temperature: 0, maxRetries: 0,
});
assert.equal(generated.text, expected);
assert.equal(generated.finishReason, 'length');
assert.equal(generated.usage.outputTokens, 24);
assert.equal(generated.usage.inputTokens, Number(process.env.CHAT_PROMPT_TOKENS));

const result = streamText({
  model: openai(model), prompt: text, maxOutputTokens: 24, temperature: 0, maxRetries: 0,
});
let sdkStreamed = '';
for await (const part of result.textStream) sdkStreamed += part;
assert.equal(sdkStreamed, expected);
assert.equal(await result.finishReason, 'length');

console.log('ALL OK');
