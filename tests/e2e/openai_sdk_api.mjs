// The official OpenAI Node SDK against the parity features of issue 12 (docs/api.md): API keys
// (AuthenticationError), models.retrieve with --served-model-name aliases, n > 1 (choice i ==
// the same request with n = 1 and seed + i; the SDK's chat stream helper assembles the n
// streamed choices), logit_bias, logprobs with top_logprobs 0, the final chunk's delta {},
// and vLLM's extra fields (stop_token_ids, min_tokens, priority, continue_final_message) sent
// through the SDK's request body.
// Usage: node openai_sdk_api.mjs <kvserve-binary> <model-path>
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { startServer, checker } from './sdk_server.mjs';

const [bin, model] = process.argv.slice(2);
const KEY = 'sk-test-kvserve';
const { check, fail, finish } = checker();
let server = null;
const ids = (choice) => choice.logprobs.tokens.map((t) => Number(t.split(':')[1]));

try {
  server = await startServer(bin, model, ['--threads', '1', '--api-key', KEY,
    '--served-model-name', 'story-model', 'story-alias']);
  const port = server.port;
  const baseURL = `http://127.0.0.1:${port}/v1`;
  const client = new OpenAI({ baseURL, apiKey: KEY, maxRetries: 0 });
  const id = 'story-model';

  await check('a wrong API key is an AuthenticationError (401)', async () => {
    const bad = new OpenAI({ baseURL, apiKey: 'sk-wrong', maxRetries: 0 });
    await assert.rejects(bad.models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.status === 401
      && e.code === 'invalid_api_key');
    await assert.rejects(bad.completions.create({ model: id, prompt: 'x', max_tokens: 2 }),
      (e) => e instanceof OpenAI.AuthenticationError);
  });
  await check('models.list and models.retrieve (aliases, 404)', async () => {
    const list = await client.models.list();
    assert.deepEqual(list.data.map((m) => m.id), ['story-model', 'story-alias']);
    const m = await client.models.retrieve('story-alias');
    assert.equal(m.id, 'story-alias');
    assert.equal(m.object, 'model');
    await assert.rejects(client.models.retrieve('gpt-4o'), (e) => e instanceof OpenAI.NotFoundError);
    const c = await client.completions.create({ model: 'story-alias', prompt: 'Once', max_tokens: 2 });
    assert.equal(c.model, 'story-model');
  });
  await check('completions n=3: choice i == n=1 with seed + i', async () => {
    const req = { model: id, prompt: 'Once upon a time', max_tokens: 20, temperature: 1.0, logprobs: 2 };
    const multi = await client.completions.create({ ...req, n: 3, seed: 77 });
    assert.equal(multi.choices.length, 3);
    for (let i = 0; i < 3; i++) {
      const one = await client.completions.create({ ...req, seed: 77 + i });
      assert.equal(multi.choices[i].index, i);
      assert.equal(multi.choices[i].text, one.choices[0].text);
      assert.deepEqual(multi.choices[i].logprobs, one.choices[0].logprobs);
    }
    assert.equal(multi.usage.completion_tokens,
      multi.choices.reduce((a, c) => a + c.logprobs.tokens.length, 0));
  });
  await check('chat n=2 streamed: the SDK stream helper assembles both choices == non-stream', async () => {
    const req = { model: id, messages: [{ role: 'user', content: 'Tell me a story' }], max_tokens: 24,
      temperature: 0.8, seed: 5, n: 2 };
    const full = await client.chat.completions.create(req);
    assert.equal(full.choices.length, 2);
    const stream = client.beta.chat.completions.stream({ ...req, stream: true });
    const fin = await stream.finalChatCompletion();
    assert.deepEqual(fin.choices.map((c) => c.message.content), full.choices.map((c) => c.message.content));
    assert.deepEqual(fin.choices.map((c) => c.finish_reason), full.choices.map((c) => c.finish_reason));
  });
  await check('chat stream: the last chunk has delta {} and the finish_reason', async () => {
    const stream = await client.chat.completions.create({ model: id, stream: true, max_tokens: 6,
      messages: [{ role: 'user', content: 'Hi' }] });
    const chunks = [];
    for await (const c of stream) chunks.push(c);
    const last = chunks[chunks.length - 1].choices[0];
    assert.deepEqual(last.delta, {});
    assert.ok(['stop', 'length'].includes(last.finish_reason));
  });
  await check('logit_bias -100 bans the greedy token; out-of-range ids are a BadRequestError', async () => {
    const req = { model: id, prompt: 'Once upon a time', max_tokens: 6, temperature: 0, logprobs: 0,
      return_tokens_as_token_ids: true };
    const base = await client.completions.create(req);
    const first = ids(base.choices[0])[0];
    const biased = await client.completions.create({ ...req, logit_bias: { [first]: -100 } });
    assert.notEqual(ids(biased.choices[0])[0], first);
    await assert.rejects(client.completions.create({ ...req, logit_bias: { 99999: 5 } }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'logit_bias');
  });
  await check('chat logprobs: true, top_logprobs: 0 gives one entry per token', async () => {
    const r = await client.chat.completions.create({ model: id, max_tokens: 5, logprobs: true, top_logprobs: 0,
      messages: [{ role: 'user', content: 'Hi' }] });
    const lp = r.choices[0].logprobs.content;
    assert.equal(lp.length, r.usage.completion_tokens);
    for (const e of lp) {
      assert.equal(typeof e.token, 'string');
      assert.equal(typeof e.logprob, 'number');
      assert.deepEqual(e.top_logprobs, []);
    }
  });
  await check('vLLM extra fields through the SDK: stop_token_ids, min_tokens, priority', async () => {
    const req = { model: id, prompt: 'Once upon a time', max_tokens: 24, temperature: 0, logprobs: 0,
      return_tokens_as_token_ids: true };
    const base = ids((await client.completions.create(req)).choices[0]);
    const t = base[6], k = base.indexOf(t);
    const stopped = await client.completions.create({ ...req, stop_token_ids: [t] });
    assert.deepEqual(ids(stopped.choices[0]), base.slice(0, k + 1));
    assert.equal(stopped.choices[0].finish_reason, 'stop');
    const held = ids((await client.completions.create({ ...req, stop_token_ids: [t], min_tokens: k + 2 })).choices[0]);
    assert.ok(held.length >= k + 2 && !held.slice(0, k + 2).includes(t));
    const pr = await client.completions.create({ ...req, priority: -10 });
    assert.deepEqual(ids(pr.choices[0]), base);
  });
  await check('continue_final_message continues the assistant message; with add_generation_prompt 400', async () => {
    const messages = [{ role: 'user', content: 'Tell me a story' }, { role: 'assistant', content: 'Once upon a time' }];
    const r = await client.chat.completions.create({ model: id, messages, max_tokens: 8, temperature: 0,
      continue_final_message: true, add_generation_prompt: false });
    const prompt = '<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\nOnce upon a time';
    const c = await client.completions.create({ model: id, prompt, max_tokens: 8, temperature: 0 });
    assert.equal(r.choices[0].message.content, c.choices[0].text);
    await assert.rejects(client.chat.completions.create({ model: id, messages, continue_final_message: true,
      add_generation_prompt: true }), (e) => e instanceof OpenAI.BadRequestError && e.param === 'continue_final_message');
  });
  await check('a user message without content is a BadRequestError', async () => {
    await assert.rejects(client.chat.completions.create({ model: id, messages: [{ role: 'user' }] }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'messages[0].content');
  });
} catch (e) {
  fail('setup', e);
} finally {
  if (server) server.stop();
}
finish();
