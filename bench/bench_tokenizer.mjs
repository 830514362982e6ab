// HF tokenizers (Rust, Node binding) encode throughput on the same paragraphs as
// bench_tokenizer.c. Run with RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false (one thread).
//   node bench_tokenizer.mjs TOKENIZER_JSON TEXT_FILE [--repeat N] [--ids OUT.jsonl]
// Times encodeBatch over all paragraphs (one native call, per-call overhead amortised) and,
// separately, await encode() per paragraph (what a Node server would do).
import fs from 'node:fs';
import { createRequire } from 'node:module';
const require = createRequire(new URL('../tests/e2e/package.json', import.meta.url));
const { Tokenizer } = require('@anush008/tokenizers');

const [tokPath, textPath] = process.argv.slice(2);
const opt = (n, d) => { const i = process.argv.indexOf(n); return i >= 0 ? process.argv[i + 1] : d; };
const repeat = parseInt(opt('--repeat', '3'), 10);
const idsOut = opt('--ids', null);
const text = fs.readFileSync(textPath, 'utf8');
const paras = text.split('\n\n').filter((p) => p.length > 0);
const bytes = paras.reduce((a, p) => a + Buffer.byteLength(p), 0);
const tok = Tokenizer.fromFile(tokPath);

let best = Infinity, tokens = 0, ids = null;
for (let r = 0; r < repeat; r++) {
  const t0 = process.hrtime.bigint();
  const enc = await tok.encodeBatch(paras, { addSpecialTokens: false });
  const dt = Number(process.hrtime.bigint() - t0) / 1e9;
  if (dt < best) best = dt;
  if (!ids) ids = enc.map((e) => e.getIds());
}
tokens = ids.reduce((a, x) => a + x.length, 0);
let bestSingle = Infinity;
for (let r = 0; r < Math.min(repeat, 2); r++) {
  const t0 = process.hrtime.bigint();
  for (const p of paras) await tok.encode(p, null, { addSpecialTokens: false });
  const dt = Number(process.hrtime.bigint() - t0) / 1e9;
  if (dt < bestSingle) bestSingle = dt;
}
if (idsOut) fs.writeFileSync(idsOut, ids.map((x) => JSON.stringify(Array.from(x))).join('\n') + '\n');
const out = (impl, s) => console.log(JSON.stringify({ impl, paragraphs: paras.length, bytes, tokens, seconds: +s.toFixed(4),
  tokens_per_s: Math.round(tokens / s), mb_per_s: +(bytes / s / 1e6).toFixed(2) }));
out('hf-encodeBatch', best);
out('hf-encode-each', bestSingle);
