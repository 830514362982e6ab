// Structured output and tool calls through the official OpenAI Node SDK (issue 12): the SDK's
// parse helper (response_format json_schema, strict tools), its stream helper (parsed content,
// tool-call arguments assembled from deltas), vLLM's guided_* fields, tool_choice required /
// named, and the 400s for unsupported schemas. Every output is checked against its schema here
// (a small validator for the keywords used), independently of the server.
// Usage: node structured_sdk.mjs <kvserve-binary> <model-path>
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { makeParseableResponseFormat } from 'openai/lib/parser';
import { startServer, checker } from './sdk_server.mjs';

const [bin, model] = process.argv.slice(2);
const { check, fail, finish } = checker();
let server = null;

// A validator for the keywords these schemas use (type, properties, required,
// additionalProperties false, enum, maxLength, minimum/maximum, items, maxItems).
function validate(schema, v, path = '$') {
  const t = schema.type;
  const is = { object: (x) => x && typeof x === 'object' && !Array.isArray(x), array: Array.isArray,
    string: (x) => typeof x === 'string', integer: Number.isInteger, number: (x) => typeof x === 'number',
    boolean: (x) => typeof x === 'boolean', null: (x) => x === null };
  if (t) assert.ok(is[t](v), `${path}: not ${t}: ${JSON.stringify(v)}`);
  if (schema.enum) assert.ok(schema.enum.some((e) => JSON.stringify(e) === JSON.stringify(v)), `${path}: not in enum`);
  if (schema.maxLength !== undefined) assert.ok([...v].length <= schema.maxLength, `${path}: too long`);
  if (schema.minimum !== undefined) assert.ok(v >= schema.minimum, `${path}: below minimum`);
  if (schema.maximum !== undefined) assert.ok(v <= schema.maximum, `${path}: above maximum`);
  if (schema.maxItems !== undefined) assert.ok(v.length <= schema.maxItems, `${path}: too many items`);
  if (schema.items) v.forEach((x, i) => validate(schema.items, x, `${path}[${i}]`));
  if (schema.properties) {
    for (const k of schema.required || []) assert.ok(k in v, `${path}: missing ${k}`);
    for (const [k, x] of Object.entries(v)) {
      if (schema.properties[k]) validate(schema.properties[k], x, `${path}.${k}`);
      else assert.ok(schema.additionalProperties !== false, `${path}: extra member ${k}`);
    }
  }
}

const petSchema = {
  type: 'object',
  properties: {
    name: { type: 'string', maxLength: 12 },
    age: { type: 'integer', minimum: 0, maximum: 30 },
    kind: { type: 'string', enum: ['dog', 'cat', 'bird'] },
    tags: { type: 'array', items: { type: 'string', maxLength: 6 }, maxItems: 3 },
  },
  required: ['name', 'age', 'kind', 'tags'],
  additionalProperties: false,
};
const weather = {
  type: 'function',
  function: {
    name: 'get_weather', strict: true,
    parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 16 }, unit: { type: 'string', enum: ['c', 'f'] } },
      required: ['city', 'unit'], additionalProperties: false },
  },
};
const clock = { type: 'function', function: { name: 'get_time', strict: true,
  parameters: { type: 'object', properties: { zone: { type: 'string', maxLength: 8 } }, required: ['zone'], additionalProperties: false } } };
const messages = [{ role: 'user', content: 'Tell me about a pet.' }];

try {
  server = await startServer(bin, model);
  const port = server.port;
  const client = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: 'unused', maxRetries: 0 });
  const id = (await client.models.list()).data[0].id;
  const rf = { type: 'json_schema', json_schema: { name: 'pet', strict: true, schema: petSchema } };

  await check('parse helper: json_schema output validates (greedy and sampled)', async () => {
    for (const [temperature, seed] of [[0, 1], [1, 2], [0.8, 3], [1.2, 4]]) {
      const c = await client.beta.chat.completions.parse({ model: id, messages, response_format: rf, max_tokens: 200, temperature, seed });
      assert.equal(c.choices[0].finish_reason, 'stop');
      validate(petSchema, c.choices[0].message.parsed);
      assert.deepEqual(c.choices[0].message.parsed, JSON.parse(c.choices[0].message.content));
    }
  });
  await check('n > 1: every choice of a json_schema request parses and validates', async () => {
    const c = await client.beta.chat.completions.parse({ model: id, messages, response_format: rf, max_tokens: 200, n: 3, seed: 9, temperature: 1 });
    assert.equal(c.choices.length, 3);
    for (const ch of c.choices) {
      assert.equal(ch.finish_reason, 'stop');
      validate(petSchema, ch.message.parsed);
    }
  });
  await check('stream helper: streamed json_schema content assembles and parses', async () => {
    // the stream helper parses auto-parseable formats (what zodResponseFormat builds)
    const prf = makeParseableResponseFormat(rf, (content) => JSON.parse(content));
    const stream = client.beta.chat.completions.stream({ model: id, messages, response_format: prf, max_tokens: 200, seed: 5, temperature: 0.9 });
    let deltas = 0;
    stream.on('content.delta', () => deltas++);
    const final = await stream.finalChatCompletion();
    validate(petSchema, final.choices[0].message.parsed);
    assert.ok(deltas > 1);
    const full = await client.chat.completions.create({ model: id, messages, response_format: rf, max_tokens: 200, seed: 5, temperature: 0.9 });
    assert.equal(final.choices[0].message.content, full.choices[0].message.content);
  });
  await check('response_format json_object gives a JSON object', async () => {
    const c = await client.chat.completions.create({ model: id, messages, response_format: { type: 'json_object' }, max_tokens: 300, seed: 7 });
    if (c.choices[0].finish_reason === 'stop') {
      const v = JSON.parse(c.choices[0].message.content);
      assert.ok(v && typeof v === 'object' && !Array.isArray(v));
    } else {
      assert.equal(c.choices[0].finish_reason, 'length');
      assert.ok(c.choices[0].message.content.startsWith('{'));
    }
  });
  await check('vLLM guided_choice / guided_regex / guided_json / guided_grammar on completions', async () => {
    const ch = await client.completions.create({ model: id, prompt: 'The cat was', max_tokens: 10, guided_choice: ['happy', 'very sad'], temperature: 1, seed: 1 });
    assert.ok(['happy', 'very sad'].includes(ch.choices[0].text));
    assert.equal(ch.choices[0].finish_reason, 'stop');
    const re = await client.completions.create({ model: id, prompt: 'Tom went to', max_tokens: 30, guided_regex: '[a-z]+ (park|shop)\\.', seed: 2 });
    assert.match(re.choices[0].text, /^[a-z]+ (park|shop)\.$/);
    const js = await client.completions.create({ model: id, prompt: 'Pet:', max_tokens: 200, guided_json: petSchema, seed: 3 });
    validate(petSchema, JSON.parse(js.choices[0].text));
    const gr = await client.completions.create({ model: id, prompt: 'Count:', max_tokens: 40,
      guided_grammar: 'root ::= num ("," num){2}\nnum ::= [1-9] [0-9]?', seed: 4 });
    assert.match(gr.choices[0].text, /^[1-9][0-9]?(,[1-9][0-9]?){2}$/);
  });
  await check('tool_choice required (non-stream): tool_calls, finish_reason tool_calls', async () => {
    const c = await client.chat.completions.create({ model: id, messages: [{ role: 'user', content: 'Weather in Paris?' }],
      tools: [weather, clock], tool_choice: 'required', parallel_tool_calls: false, max_tokens: 200, seed: 11, temperature: 0.7 });
    const m = c.choices[0].message;
    assert.equal(c.choices[0].finish_reason, 'tool_calls');
    assert.equal(m.tool_calls.length, 1);
    assert.equal(m.content, null);
    const call = m.tool_calls[0];
    assert.equal(call.type, 'function');
    assert.match(call.id, /^call_[A-Za-z0-9]{24}$/);
    const tool = [weather, clock].find((t) => t.function.name === call.function.name);
    assert.ok(tool, call.function.name);
    validate(tool.function.parameters, JSON.parse(call.function.arguments));
  });
  await check('named tool_choice through the stream helper: arguments assembled and parsed', async () => {
    const stream = client.beta.chat.completions.stream({ model: id, messages: [{ role: 'user', content: 'Time?' }],
      tools: [weather, clock], tool_choice: { type: 'function', function: { name: 'get_time' } }, parallel_tool_calls: false,
      max_tokens: 200, seed: 12 });
    const done = [];
    stream.on('tool_calls.function.arguments.done', (e) => done.push(e));
    const final = await stream.finalChatCompletion();
    const calls = final.choices[0].message.tool_calls;
    assert.equal(calls.length, 1);
    assert.equal(calls[0].function.name, 'get_time');
    validate(clock.function.parameters, calls[0].function.parsed_arguments);
    assert.equal(done.length, 1);
    assert.equal(final.choices[0].finish_reason, 'tool_calls');
  });
  await check('parse helper with strict tools: parsed_arguments', async () => {
    const c = await client.beta.chat.completions.parse({ model: id, messages: [{ role: 'user', content: 'Weather?' }],
      tools: [weather], tool_choice: 'required', parallel_tool_calls: false, max_tokens: 200, seed: 13 });
    const call = c.choices[0].message.tool_calls[0];
    assert.equal(call.function.name, 'get_weather');
    validate(weather.function.parameters, call.function.parsed_arguments);
  });
  await check('parallel tool calls: every completed call validates', async () => {
    const c = await client.chat.completions.create({ model: id, messages: [{ role: 'user', content: 'Weather and time?' }],
      tools: [weather, clock], tool_choice: 'required', max_tokens: 160, seed: 14, temperature: 1 });
    const calls = c.choices[0].message.tool_calls || [];
    assert.ok(calls.length >= 1);
    for (const call of calls) {
      const tool = [weather, clock].find((t) => t.function.name === call.function.name);
      validate(tool.function.parameters, JSON.parse(call.function.arguments));
    }
    assert.ok(['tool_calls', 'length'].includes(c.choices[0].finish_reason));
  });
  await check('unsupported schema keyword is a 400 naming it', async () => {
    await assert.rejects(client.chat.completions.create({ model: id, messages, max_tokens: 5,
      response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'object', patternProperties: { a: {} } } } } }),
    (e) => e instanceof OpenAI.BadRequestError && /patternProperties/.test(e.message) && e.param === 'response_format.json_schema.schema'
        && /response_format\.json_schema\.schema: unsupported/.test(e.message));
    await assert.rejects(client.completions.create({ model: id, prompt: 'x', max_tokens: 5, guided_regex: '(a)\\1' }),
      (e) => e.status === 400 && /backreference/.test(e.message) && e.param === 'guided_regex');
    await assert.rejects(client.chat.completions.create({ model: id, messages, max_tokens: 5, tools: [weather],
      tool_choice: { type: 'function', function: { name: 'nope' } } }), (e) => e.status === 400 && e.param === 'tool_choice');
  });
} catch (e) {
  fail('setup', e);
} finally {
  if (server) server.stop();
}
finish();
