// Seeded generator of tokenizer test inputs: random Unicode across scripts, emoji sequences,
// whitespace runs, digit runs, special-token text inside prose, punctuation/contractions,
// prose slices and a few ~100 kB strings. Every string is well-formed Unicode (no lone
// surrogates), so it survives JSON on both sides unchanged.
import fs from 'node:fs';

export function rng(seed) {
  let a = seed >>> 0;
  const next = () => { // mulberry32
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const int = (n) => Math.floor(next() * n);
  const pick = (arr) => arr[int(arr.length)];
  return { next, int, pick };
}

const R = (a, b) => [a, b];
const SCRIPTS = {
  latin: [R(0x41, 0x5a), R(0x61, 0x7a)],
  latin1: [R(0xc0, 0xff), R(0x100, 0x17f), R(0x180, 0x24f)],
  cyrillic: [R(0x410, 0x44f), R(0x400, 0x40f), R(0x450, 0x45f)],
  greek: [R(0x391, 0x3a9), R(0x3b1, 0x3c9), R(0x1f00, 0x1f15)],
  cjk: [R(0x4e00, 0x4fff), R(0x5000, 0x9fff), R(0x3400, 0x34ff)],
  kana: [R(0x3041, 0x3096), R(0x30a1, 0x30fa)],
  arabic: [R(0x621, 0x64a), R(0x64b, 0x652), R(0x660, 0x669)],
  hebrew: [R(0x5d0, 0x5ea), R(0x5b0, 0x5bc)],
  devanagari: [R(0x905, 0x939), R(0x93e, 0x94d), R(0x966, 0x96f)],
  thai: [R(0xe01, 0xe2e), R(0xe31, 0xe3a), R(0xe40, 0xe4e)],
  hangul: [R(0xac00, 0xd7a3), R(0x1100, 0x1112), R(0x1161, 0x1175)],
  combining: [R(0x300, 0x36f), R(0x1ab0, 0x1ace), R(0x20d0, 0x20f0), R(0x1dc0, 0x1dff), R(0x898, 0x8d3),
              R(0x591, 0x5c7), R(0x610, 0x61a), R(0x64b, 0x65f), R(0x10efd, 0x10eff), R(0x16ff0, 0x16ff1)],
  recent: [R(0x1fae0, 0x1faf8), R(0x11f00, 0x11f59), R(0x31350, 0x323af), R(0x0378, 0x0379), R(0x0870, 0x089f),
           R(0x1e4d0, 0x1e4f9), R(0x2ebf0, 0x2ee5d), R(0x1b132, 0x1b155), R(0x10efd, 0x10eff), R(0xe0000, 0xe007f)],
  misc: [R(0xff01, 0xff5e), R(0x1d400, 0x1d4ff), R(0x2160, 0x2188), R(0xb2, 0xb3), R(0xbc, 0xbe), R(0x2070, 0x2079),
         R(0x2200, 0x22ff), R(0x20a0, 0x20bf), R(0x2500, 0x257f), R(0xe000, 0xe00f), R(0x10000, 0x1000f)],
  controls: [R(0x0, 0x8), R(0xe, 0x1f), R(0x7f, 0x9f), R(0x200b, 0x200f), R(0xfeff, 0xfeff), R(0x2060, 0x2064)],
};
const SCRIPT_NAMES = Object.keys(SCRIPTS);
const WS = [' ', ' ', ' ', '\u180e', '\u001c', '\u001f', '\u2029', '\u2000', '\u2007', '\u200b', '\t', '\n', '\r\n', '\r', '\u00a0', '\u3000', '\u2028', '\u000b', '\u000c', '\u0085',
            '\u2009', '\u200a', '\u202f', '\u205f', '\u1680'];
const EMOJI = ['😀', '😂', '🦙', '👍', '❤️', '🔥', '🎉', '🤖', '🧠', '☕', '⭐', '✅', '🇺', '🏳️‍🌈', '👩‍💻', '👨‍👩‍👧‍👦',
               '🧑🏽‍🚀', '🙋🏿‍♀️', '✌🏻', '1️⃣', '#️⃣', '©️', '™', '🫠', '🦄', '🐈‍⬛', '❤️‍🔥', '😶‍🌫️'];
const SKIN = ['\u{1f3fb}', '\u{1f3fc}', '\u{1f3fd}', '\u{1f3fe}', '\u{1f3ff}'];
const PUNCT = ['.', ',', '!', '?', ';', ':', '-', '--', '...', '…', '—', '–', '"', "'", '`', '(', ')', '[', ']',
               '{', '}', '<', '>', '/', '\\', '|', '@', '#', '$', '%', '^', '&', '*', '_', '+', '=', '~', '«', '»',
               '“', '”', '‘', '’', '¿', '¡', '。', '、', '，', '！', '？', '：', '·', '•', '§', '¶', '†', '€', '£'];
const CONTRACTIONS = ["'s", "'S", "'t", "'T", "'re", "'RE", "'Re", "'ve", "'VE", "'m", "'M", "'ll", "'LL", "'Ll",
                      "'d", "'D", "n't", "N'T", "’s", "’ll", "'", "''", "'x", "'ſ", "'ſt", "'K", "'Ｓ"];
const WORDS = ['the', 'The', 'THE', 'hello', 'Hello', 'world', 'token', 'izer', 'Prince', 'Andrew', 'naïve',
               'café', 'Ünïcödé', 'Straße', 'İstanbul', 'ǅemal', 'ﬁne', 'Москва', 'Ελλάδα', '東京', '北京市',
               'שלום', 'مرحبا', 'नमस्ते', 'สวัสดี', '안녕하세요', 'こんにちは', 'e\u0301', 'a\u0308', 'n\u0303o',
               'don', 'I', 'it', 'you', 'we', 'they', 'https://example.com/a?b=c&d=e', 'foo_bar', 'fooBar',
               'x86_64', 'C++', 'e-mail', 'user@example.org', '$100', '3.14159', '1,000,000', '2024-01-31',
               '12:30', '0x7fff', '#include', 'int main()', '<div>', '</div>', '&amp;', '\\n', '    return x;'];
const GENERIC_SPECIAL = ['<|im_end|>', '<|im_start|>', '<s>', '</s>', '<unk>', '<|begin_of_text|>',
                         '<|end_of_text|>', '<|eot_id|>', '<|endoftext|>', '<|start_header_id|>',
                         '<|end_header_id|>', '<think>', '</think>', '<tool_call>', '<|fim_prefix|>',
                         '<|im_end|', '< s>', '<<s>>', '<s', 's>', '<|', '|>', '<|reserved_special_token_5|>'];

function cp(r, ranges) {
  const [a, b] = r.pick(ranges);
  return String.fromCodePoint(a + r.int(b - a + 1));
}

export function makeGen(seed, specials, prose) {
  const r = rng(seed);
  const sp = [...new Set([...specials, ...GENERIC_SPECIAL])];
  const frag = {
    script: () => {
      const s = SCRIPTS[r.pick(SCRIPT_NAMES)];
      let o = '';
      for (let n = 1 + r.int(12); n > 0; n--) o += cp(r, s);
      return o;
    },
    mixed: () => {
      let o = '';
      for (let n = 1 + r.int(20); n > 0; n--) o += cp(r, SCRIPTS[r.pick(SCRIPT_NAMES)]);
      return o;
    },
    emoji: () => {
      let o = '';
      for (let n = 1 + r.int(5); n > 0; n--) {
        const k = r.int(5);
        if (k === 0) o += String.fromCodePoint(0x1f1e6 + r.int(26), 0x1f1e6 + r.int(26)); // flag
        else if (k === 1) o += r.pick(['👋', '👍', '🧑', '👩', '✋']) + r.pick(SKIN);
        else if (k === 2) o += r.pick(EMOJI) + '\u200d' + r.pick(EMOJI);
        else o += r.pick(EMOJI);
      }
      return o;
    },
    ws: () => {
      let o = '';
      for (let n = 1 + r.int(8); n > 0; n--) o += r.pick(WS).repeat(1 + (r.int(4) === 0 ? r.int(20) : 0));
      return o;
    },
    digits: () => {
      const sets = ['0123456789', '٠١٢٣٤٥٦٧٨٩', '०१२३४५६७८९', '０１２３４５６７８９', '²³¹½¼¾', 'ⅠⅡⅢⅣⅫ'];
      const s = [...(r.int(4) ? sets[0] : r.pick(sets))];
      let o = '';
      for (let n = 1 + r.int(r.int(3) === 0 ? 40 : 8); n > 0; n--) o += r.pick(s);
      return o;
    },
    special: () => r.pick(sp),
    punct: () => {
      let o = '';
      for (let n = 1 + r.int(4); n > 0; n--) o += r.pick(PUNCT);
      return o;
    },
    contraction: () => r.pick(WORDS) + r.pick(CONTRACTIONS),
    word: () => r.pick(WORDS),
    prose: () => {
      const a = r.int(Math.max(1, prose.length - 400));
      return prose.slice(a, a + 1 + r.int(300)).replace(/[\ud800-\udfff]/g, '');
    },
  };
  const kinds = Object.keys(frag);
  const seps = ['', ' ', ' ', ' ', '\n', '', '  '];
  return {
    next() {
      const k = r.int(10);
      let n = k < 3 ? 1 : 2 + r.int(k < 8 ? 6 : 20);
      let o = '';
      for (; n > 0; n--) o += frag[r.pick(kinds)]() + r.pick(seps);
      if (r.int(6) === 0) o = r.pick(WS) + o; // leading whitespace
      if (r.int(6) === 0) o = o.trimEnd();
      return o;
    },
    big(bytes) {
      let o = '';
      while (Buffer.byteLength(o) < bytes) o += frag[r.pick(kinds)]() + r.pick(seps);
      return o;
    },
    repeated() {
      const unit = r.pick(['a', ' ', '\n', '0', '🦙', '日', 'ab', '\u00a0', '.', 'é', 'e\u0301', '<s>', '\t ']);
      return unit.repeat(100 + r.int(5000));
    },
  };
}

export function loadProse(dataDir) {
  try {
    return fs.readFileSync(`${dataDir}/datasets/war-and-peace.txt`, 'utf8').slice(0, 400000);
  } catch {
    return 'It was in July, 1805, and the speaker was the well-known Anna Pávlovna Schérer.';
  }
}
