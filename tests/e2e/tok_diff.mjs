// Differential test: kvserve's tokenizer against Hugging Face `tokenizers` (Rust, through its
// Node binding) on generated inputs, encode and decode, in batch.
//
//   node tok_diff.mjs KVSERVE_BIN DATA_DIR [--cases N] [--seed S] [--only qwen3,gpt2] [--show K]
//
// For each tokenizer: a seeded generator makes N cases (+ ~100 kB strings and long repeats);
// HF encodes them all (encodeBatch, add_special_tokens false and true); one
// `kvserve tokenize --lines --with-special [--no-bos]` process encodes them all; ids must be
// identical. HF always matches special-token text, so kvserve runs with --with-special.
// Then HF decodeBatch (skip_special_tokens false/true) and one `kvserve detokenize --lines`
// per mode decode HF's add_special=true ids; texts must be identical.
// Exit code: 0 all equal, 1 differences (each printed: escaped input, both id lists around the
// first differing position), 2 setup error.
import { spawn } from 'node:child_process';
import { createRequire } from 'node:module';
import { makeGen, loadProse } from './tok_cases.mjs';

const require = createRequire(import.meta.url);
const { Tokenizer } = require('@anush008/tokenizers');

const args = process.argv.slice(2);
const bin = args[0], data = args[1];
const opt = (name, def) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : def;
};
const nCases = parseInt(opt('--cases', '20000'), 10);
const seed = parseInt(opt('--seed', '1234'), 10);
const show = parseInt(opt('--show', '5'), 10);
const only = opt('--only', 'qwen3,llama3,mistral,gpt2,llama2').split(',');
if (!bin || !data) {
  console.error('usage: node tok_diff.mjs KVSERVE_BIN DATA_DIR [--cases N] [--seed S] [--only a,b]');
  process.exit(2);
}

function run(cmd, argv, input) {
  return new Promise((resolve, reject) => {
    const p = spawn(cmd, argv, { stdio: ['pipe', 'pipe', 'pipe'] });
    const out = [], err = [];
    p.stdout.on('data', (d) => out.push(d));
    p.stderr.on('data', (d) => err.push(d));
    p.on('error', reject);
    p.on('close', (code) => {
      if (code !== 0) reject(new Error(`${cmd} ${argv.join(' ')}: exit ${code}: ${Buffer.concat(err)}`));
      else resolve(Buffer.concat(out).toString('utf8'));
    });
    p.stdin.on('error', () => {});
    p.stdin.end(input);
  });
}

const esc = (s, max = 400) => {
  const j = JSON.stringify(s);
  return j.length > max ? `${j.slice(0, max)}... (${s.length} UTF-16 units)` : j;
};
const firstDiff = (a, b) => {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return i;
  return a.length === b.length ? -1 : n;
};
const window = (ids, at) => {
  const lo = Math.max(0, at - 8), hi = Math.min(ids.length, at + 12);
  return `${lo ? '... ' : ''}[${ids.slice(lo, hi).join(',')}]${hi < ids.length ? ' ...' : ''} (len ${ids.length})`;
};
// The input text near the token where they diverge (HF offsets are not used: decode HF's
// prefix ids to locate it).
async function context(hf, text, ids, at) {
  if (text.length <= 400) return esc(text);
  const pre = await hf.decode(ids.slice(0, Math.max(0, at)), false);
  const k = Math.max(0, pre.length - 60);
  return `${esc(text, 120)}\n    near UTF-16 offset ~${pre.length}: ${esc(text.slice(k, k + 200))}`;
}

async function hfEncodeAll(hf, cases, addSpecial) {
  const out = [];
  for (let i = 0; i < cases.length; i += 2000) {
    const enc = await hf.encodeBatch(cases.slice(i, i + 2000), { addSpecialTokens: addSpecial });
    for (const e of enc) out.push(Array.from(e.getIds()));
  }
  return out;
}

async function main() {
  const prose = loadProse(data);
  let totalBad = 0;
  for (const [ti, name] of only.entries()) {
    const dir = `${data}/tokenizers/${name}`;
    const t0 = Date.now();
    const hf = Tokenizer.fromFile(`${dir}/tokenizer.json`);
    const specials = Object.keys(hf.getVocab(true)).filter((s) => /^<.*>$/.test(s) && s.length < 40).slice(0, 300);
    const gen = makeGen(seed * 31 + ti, specials, prose);
    const cases = [];
    for (let i = 0; i < nCases; i++) cases.push(gen.next());
    for (let i = 0; i < 5; i++) cases.push(gen.big(100000));
    for (let i = 0; i < 20; i++) cases.push(gen.repeated());
    const input = cases.map((c) => JSON.stringify(c)).join('\n') + '\n';
    const bytes = cases.reduce((a, c) => a + Buffer.byteLength(c), 0);

    // encode: kvserve (two processes) runs while HF encodes
    const cRuns = Promise.all([
      run(bin, ['tokenize', '--tokenizer', dir, '--lines', '--with-special', '--no-bos'], input),
      run(bin, ['tokenize', '--tokenizer', dir, '--lines', '--with-special'], input),
    ]);
    const hfIds = [await hfEncodeAll(hf, cases, false), await hfEncodeAll(hf, cases, true)];
    const cOut = (await cRuns).map((o) => o.trimEnd().split('\n').map((l) => JSON.parse(l)));
    let bad = 0, shown = 0, nTok = 0;
    for (let m = 0; m < 2; m++) {
      if (cOut[m].length !== cases.length) {
        console.log(`${name}: kvserve returned ${cOut[m].length} lines for ${cases.length} cases`);
        bad++;
        continue;
      }
      for (let i = 0; i < cases.length; i++) {
        const h = hfIds[m][i], c = cOut[m][i];
        nTok += h.length;
        let d = firstDiff(h, c);
        if (d < 0) continue;
        bad++;
        if (shown++ < show) {
          console.log(`MISMATCH ${name} encode add_special=${m === 1} case ${i} first differing position ${d}`);
          console.log(`  input: ${await context(hf, cases[i], h, d)}`);
          console.log(`  hf:      ${window(h, d)}`);
          console.log(`  kvserve: ${window(c, d)}`);
        }
      }
    }
    // decode parity on HF's ids (add_special=true), both skip modes
    const idLines = hfIds[1].map((ids) => JSON.stringify(ids)).join('\n') + '\n';
    const cDec = Promise.all([
      run(bin, ['detokenize', '--tokenizer', dir, '--lines'], idLines),
      run(bin, ['detokenize', '--tokenizer', dir, '--lines', '--skip-special'], idLines),
    ]);
    const hfDec = [];
    for (const skip of [false, true]) {
      const all = [];
      for (let i = 0; i < cases.length; i += 2000) all.push(...(await hf.decodeBatch(hfIds[1].slice(i, i + 2000), skip)));
      hfDec.push(all);
    }
    const cDecOut = (await cDec).map((o) => o.trimEnd().split('\n').map((l) => JSON.parse(l)));
    let badDec = 0;
    for (let m = 0; m < 2; m++) {
      for (let i = 0; i < cases.length; i++) {
        const h = hfDec[m][i], c = cDecOut[m][i];
        if (h === c) continue;
        badDec++;
        if (shown++ < show) {
          let k = 0;
          while (k < h.length && h[k] === c[k]) k++;
          console.log(`MISMATCH ${name} decode skip_special=${m === 1} case ${i} first differing UTF-16 offset ${k}`);
          console.log(`  ids:     ${window(hfIds[1][i], 0)}`);
          console.log(`  hf:      ${esc(h.slice(Math.max(0, k - 40), k + 160))}`);
          console.log(`  kvserve: ${esc((c ?? '').slice(Math.max(0, k - 40), k + 160))}`);
        }
      }
    }
    const secs = (Date.now() - t0) / 1000;
    console.log(`${name}: ${cases.length} cases x 2 modes (${(bytes / 1e6).toFixed(1)} MB, ${nTok} tokens): ` +
                `${bad} encode differences, ${badDec} decode differences, ` +
                `${secs.toFixed(1)} s`);
    totalBad += bad + badDec;
  }
  if (totalBad) {
    console.log(`FAIL: ${totalBad} differences`);
    process.exit(1);
  }
  console.log('OK: kvserve and HF tokenizers agree on every case');
}

main().catch((e) => {
  console.error(e.stack || String(e));
  process.exit(2);
});
