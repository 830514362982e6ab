// Acceptance: the official OpenAI Node SDK drives kvserve's completions and chat endpoints,
// streaming and not; the concatenated stream deltas equal the non-stream text.
// Usage: node openai_sdk.mjs <kvserve-binary> <model-path>
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { startServer, checker } from './sdk_server.mjs';

const [bin, model] = process.argv.slice(2);
const { check, fail, finish } = checker();
let server = null;

try {
  server = await startServer(bin, model);
  const port = server.port;
  const client = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: 'unused', maxRetries: 0 });
  const models = await client.models.list();
  const id = models.data[0].id;

  const prompts = ['Once upon a time', 'The little dog', 'Lily wanted to', 'Tom and his mom went'];
  for (const prompt of prompts) {
    await check(`completions stream == non-stream: ${prompt}`, async () => {
      const req = { model: id, prompt, max_tokens: 40, temperature: 0 };
      const full = await client.completions.create(req);
      assert.equal(full.object, 'text_completion');
      assert.equal(full.choices.length, 1);
      assert.ok(['stop', 'length'].includes(full.choices[0].finish_reason));
      assert.ok(full.usage.completion_tokens > 0 && full.usage.prompt_tokens > 0);
      let text = '', finish = null, usage = null;
      const stream = await client.completions.create({ ...req, stream: true, stream_options: { include_usage: true } });
      for await (const chunk of stream) {
        if (chunk.usage) usage = chunk.usage;
        for (const c of chunk.choices) { text += c.text; if (c.finish_reason) finish = c.finish_reason; }
      }
      assert.equal(text, full.choices[0].text);
      assert.equal(finish, full.choices[0].finish_reason);
      assert.deepEqual(usage && usage.completion_tokens, full.usage.completion_tokens);
    });
    await check(`chat stream == non-stream: ${prompt}`, async () => {
      const req = { model: id, messages: [{ role: 'system', content: 'You tell stories.' },
        { role: 'user', content: prompt }], max_tokens: 40, temperature: 0 };
      const full = await client.chat.completions.create(req);
      assert.equal(full.object, 'chat.completion');
      assert.equal(full.choices[0].message.role, 'assistant');
      let text = '', finish = null, role = null;
      const stream = await client.chat.completions.create({ ...req, stream: true });
      for await (const chunk of stream) {
        assert.equal(chunk.object, 'chat.completion.chunk');
        for (const c of chunk.choices) {
          if (c.delta.role) role = c.delta.role;
          if (c.delta.content) text += c.delta.content;
          if (c.finish_reason) finish = c.finish_reason;
        }
      }
      assert.equal(role, 'assistant');
      assert.equal(text, full.choices[0].message.content);
      assert.equal(finish, full.choices[0].finish_reason);
    });
  }
  await check('seeded sampling is reproducible through the SDK', async () => {
    const req = { model: id, prompt: 'Once upon a time', max_tokens: 30, temperature: 0.9, top_p: 0.95, seed: 1234 };
    const a = await client.completions.create(req);
    const b = await client.completions.create(req);
    assert.equal(a.choices[0].text, b.choices[0].text);
  });
  await check('unknown model is a 404 NotFoundError', async () => {
    await assert.rejects(client.completions.create({ model: 'no-such-model', prompt: 'x', max_tokens: 2 }),
      (e) => e.status === 404 && e instanceof OpenAI.NotFoundError);
  });
  await check('invalid parameter is a 400 BadRequestError', async () => {
    await assert.rejects(client.completions.create({ model: id, prompt: 'x', max_tokens: -3 }),
      (e) => e.status === 400 && e instanceof OpenAI.BadRequestError);
  });
  await check('streamed error before first byte is a real HTTP status', async () => {
    await assert.rejects(client.chat.completions.create({ model: id, messages: [], stream: true }),
      (e) => e.status === 400);
  });
} catch (e) {
  fail('setup', e);
} finally {
  if (server) server.stop();
}
finish();
