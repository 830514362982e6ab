// Differential test: kvserve's Jinja interpreter vs @huggingface/jinja on real chat templates.
//   node chat_template_diff.mjs KVSERVE_BIN DATA_DIR [cases_per_template]
// For each template, a seeded generator makes conversations (turn counts, system or not,
// unicode, whitespace edge cases, empty content, think blocks, tool calls/messages,
// add_generation_prompt true/false). Both engines render every case; the texts must be
// byte-identical, or both must fail (e.g. Gemma's raise_exception on non-alternating roles).
import { Template } from "@huggingface/jinja";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";

const [bin, data, perArg] = process.argv.slice(2);
const PER = Number(perArg || 60);

function rng(seed) { // mulberry32
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const PIECES = [
  "Hello", "world", "What is 2+2?", "Tell me a story.", "", " ", "\n", "  leading", "trailing  ", "\n\nblank lines\n\n",
  "tab\there", "naïve café", "日本語のテキスト", "emoji 😀🎉", "Ünïcödé", "\u00a0nbsp\u00a0", "\u3000ideographic\u3000",
  "quotes \"double\" and 'single'", "back\\slash", "{{ not a tag }}", "{% raw %}", "<|im_end|>", "<tool_response>",
  "</tool_response>", "line1\nline2\r\nline3", "مرحبا", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "a".repeat(50), "#", "```json\n{}\n```",
];

function text(r) {
  const n = Math.floor(r() * 4);
  let s = "";
  for (let i = 0; i < n; i++) s += (i ? (r() < 0.7 ? " " : "\n") : "") + PIECES[Math.floor(r() * PIECES.length)];
  return s;
}

function assistantText(r, think) {
  if (think && r() < 0.4) {
    const pre = r() < 0.5 ? "<think>\n" : (r() < 0.5 ? "<think>" : "");
    return pre + text(r) + (r() < 0.5 ? "\n</think>\n\n" : "</think>") + text(r);
  }
  return text(r);
}

function toolCall(r, argsAsString) {
  const args = { city: text(r) || "Paris", days: Math.floor(r() * 5), units: r() < 0.5 ? "metric" : null };
  return { type: "function", function: { name: r() < 0.5 ? "get_weather" : "search", arguments: argsAsString ? JSON.stringify(args) : args } };
}

const TOOLS = [
  { type: "function", function: { name: "get_weather", description: "Weather for a city", parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } } },
  { type: "function", function: { name: "search", description: "Search the web — ünïcode", parameters: { type: "object", properties: { q: { type: "string" }, n: { type: "integer", default: 3 } } } } },
];

// kind: "plain" (system/user/assistant), "qwen" (think blocks, tools, tool role), "deepseek" (tool calls with null content)
function conversation(r, kind) {
  const msgs = [];
  if (r() < 0.5) msgs.push({ role: "system", content: text(r) });
  const turns = 1 + Math.floor(r() * 6);
  const strict = r() < 0.85; // alternate user/assistant (templates like Gemma require it)
  let role = "user";
  for (let i = 0; i < turns; i++) {
    if (!strict) role = ["user", "assistant", "system"][Math.floor(r() * 3)];
    if (role === "user") {
      msgs.push({ role: "user", content: text(r) });
    } else if (kind === "qwen" && r() < 0.3) {
      msgs.push({ role: "assistant", content: r() < 0.5 ? "" : text(r), tool_calls: [toolCall(r, r() < 0.5), ...(r() < 0.3 ? [toolCall(r, false)] : [])] });
      const nt = 1 + Math.floor(r() * 2);
      for (let k = 0; k < nt; k++) msgs.push({ role: "tool", content: text(r) });
      msgs.push({ role: "assistant", content: assistantText(r, true) });
    } else if (kind === "deepseek" && r() < 0.3) {
      msgs.push({ role: "assistant", content: null, tool_calls: [toolCall(r, true), ...(r() < 0.4 ? [toolCall(r, true)] : [])] });
      const nt = 1 + Math.floor(r() * 2);
      for (let k = 0; k < nt; k++) msgs.push({ role: "tool", content: text(r) });
      if (r() < 0.7) msgs.push({ role: "assistant", content: text(r) });
    } else {
      msgs.push({ role: "assistant", content: assistantText(r, kind === "qwen") });
    }
    role = role === "user" ? "assistant" : "user";
  }
  const doc = { messages: msgs, add_generation_prompt: r() < 0.7 };
  if (kind === "qwen") {
    if (r() < 0.3) doc.tools = TOOLS.slice(0, 1 + Math.floor(r() * 2));
    if (r() < 0.3) doc.enable_thinking = r() < 0.5;
    if (r() < 0.2) msgs[msgs.length - 1].reasoning_content = text(r);
  }
  return doc;
}

// Synthetic templates that exercise the rest of the supported subset.
const SYNTHETIC = [
  `{%- macro show(m, sep=": ") -%}{{ m.role | upper }}{{ sep }}{{ m.content | trim }}{%- endmacro -%}
{%- for m in messages if m.role != "system" -%}
{{ loop.index }}/{{ loop.length }} {{ show(m) }}{% if not loop.last %} | {% endif %}
{%- endfor %}{{ messages | length }} {{ (messages | first).role }} {{ (messages | last).role }}`,
  `{%- set ns = namespace(n=0, roles=[]) -%}{%- for m in messages -%}{%- set ns.n = ns.n + m.content|length -%}{%- endfor -%}
{{ ns.n }} {{ messages | map(attribute="role") | join(",") }} {{ messages | selectattr("role", "equalto", "user") | list | length }}
{{ messages | rejectattr("content") | list | length }} {{ messages[::-1][0].content | replace(" ", "_") }}
{{ messages[0].content.split(" ") | tojson }} {{ messages[0].content[1:4] }} {{ messages[-1].content.startswith("Hello") }}
{{ {"a": 1, "b": [true, none, 2.5]} | tojson }} {{ {"a": 1, "b": "x"} | tojson(indent=2) }} {{ [1, 2] ~ "x" }} {{ 7 // 2 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ -3 % 2 }}
{{ "abc" in messages[0].content }} {{ messages[0].content is string }} {{ messages[0].foo is defined }} {{ none is none }}
{{ messages[0].content.title() }} {{ messages[0].content.lower().strip() }} {{ add_generation_prompt | string }}
{%- for k, v in {"x": 1, "y": 2} | items %} {{ k }}={{ v }}{% endfor %}{# comment #}
{%- set block %}  inner {{ messages | length }}  {% endset %}[{{ block }}]{{ "%d" if false else "yes" }}`,
  `{%- for m in messages -%}
  {%- if loop.index0 > 3 %}{% break %}{% endif -%}
  {%- if m.role == "assistant" %}{% continue %}{% endif -%}
  <{{ m.role }}>{{ m.content | default("EMPTY", true) }}</{{ m.role }}>
{% else %}no messages{% endfor -%}
{{- raise_exception("too many: " ~ messages|length) if messages|length > 6 else "" }}`,
];

const templates = [];
for (const name of ["qwen3", "llama3"]) {
  const dir = path.join(data, "tokenizers", name);
  const f = path.join(dir, "tokenizer_config.json");
  if (fs.existsSync(f)) templates.push({ name, cfg: JSON.parse(fs.readFileSync(f, "utf8")), args: ["--tokenizer", dir], kind: name === "qwen3" ? "qwen" : "plain" });
}
for (const name of ["deepseek_v3", "gemma3", "llama3_1"]) {
  const f = path.join(data, "chat-templates", `${name}.tokenizer_config.json`);
  if (fs.existsSync(f)) templates.push({ name, cfg: JSON.parse(fs.readFileSync(f, "utf8")), args: ["--config", f], kind: name === "deepseek_v3" ? "deepseek" : "plain" });
}
SYNTHETIC.forEach((src, i) => {
  const f = path.join(process.env.TMPDIR || "/tmp", `kvserve_synth_${process.pid}_${i}.jinja`);
  fs.writeFileSync(f, src);
  templates.push({ name: `synthetic${i}`, cfg: { chat_template: src, bos_token: "<s>", eos_token: "</s>" }, args: ["--template-file", f], kind: "plain", tmp: f });
});
if (templates.length < 6) console.log(`note: only ${templates.length} templates found under ${data}`);

const tokText = (t) => (t == null ? null : typeof t === "string" ? t : t.content ?? null);
let failures = 0, total = 0;
for (const [ti, T] of templates.entries()) {
  const r = rng(1234 + ti);
  const tpl = new Template(T.cfg.chat_template);
  const docs = [], expected = [];
  for (let i = 0; i < PER; i++) {
    const doc = conversation(r, T.kind);
    docs.push(doc);
    try {
      const ctx = { ...doc, bos_token: tokText(T.cfg.bos_token), eos_token: tokText(T.cfg.eos_token) };
      expected.push({ text: tpl.render(ctx) });
    } catch (e) {
      expected.push({ error: String(e.message || e) });
    }
  }
  const res = spawnSync(bin, ["chat-template", ...T.args, "--lines"], { input: docs.map((d) => JSON.stringify(d)).join("\n") + "\n", maxBuffer: 1 << 28 });
  if (T.tmp) fs.unlinkSync(T.tmp);
  if (res.status !== 0) {
    console.log(`FAIL ${T.name}: kvserve exited ${res.status}: ${res.stderr}`);
    failures++;
    continue;
  }
  const got = res.stdout.toString("utf8").split("\n").filter((l) => l.length).map((l) => JSON.parse(l));
  let bad = 0, errs = 0;
  for (let i = 0; i < PER; i++) {
    total++;
    const e = expected[i], g = got[i] || { error: "missing output" };
    if (e.error !== undefined && g.error !== undefined) { errs++; continue; }
    if (e.text !== undefined && g.text === e.text) continue;
    bad++;
    if (bad <= 3) {
      console.log(`MISMATCH ${T.name} case ${i}: ${JSON.stringify(docs[i])}`);
      if (e.text !== undefined && g.text !== undefined) {
        let k = 0;
        while (k < e.text.length && e.text[k] === g.text[k]) k++;
        console.log(`  first difference at char ${k}:\n  hf:      ${JSON.stringify(e.text.slice(Math.max(0, k - 40), k + 60))}\n  kvserve: ${JSON.stringify(g.text.slice(Math.max(0, k - 40), k + 60))}`);
      } else {
        console.log(`  hf: ${JSON.stringify(e).slice(0, 300)}\n  kvserve: ${JSON.stringify(g).slice(0, 300)}`);
      }
    }
  }
  failures += bad;
  console.log(`${bad ? "FAIL" : "ok  "} ${T.name}: ${PER - bad}/${PER} identical (${errs} rejected by both)`);
}
console.log(failures ? `${failures} mismatches in ${total} renders` : `all ${total} renders identical`);
process.exit(failures ? 1 : 0);
