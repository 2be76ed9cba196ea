// The official openai client against a pdmoe endpoint: a streamed chat completion equals the
// non-streamed answer of the same greedy request and names the role first; stop ends the text
// before the stop string, streamed or not; usage comes in the stream with include_usage; n = 2
// and logprobs are refused by name with a 400. Usage: node openai_stream.mjs URL MODEL
import OpenAI from 'openai';

const [url, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'unused' });
const request = { model, messages: [{ role: 'user', content: 'Hello, who are you?' }], max_tokens: 24, temperature: 0 };

const stream = await client.chat.completions.create({ ...request, stream: true });
let text = '';
let chunks = 0;
let finish = null;
for await (const chunk of stream) {
  chunks++;
  text += chunk.choices[0]?.delta?.content ?? '';
  finish = chunk.choices[0]?.finish_reason ?? finish;
}
const plain = await client.chat.completions.create(request);
const want = plain.choices[0].message.content;
if (text !== want) throw new Error(`streamed text ${JSON.stringify(text)} differs from ${JSON.stringify(want)}`);
if (!finish) throw new Error('no finish_reason in the stream');
if (chunks < 2) throw new Error(`only ${chunks} chunks`);
const models = await client.models.list();
if (!models.data.some((m) => m.id === model)) throw new Error(`model ${model} not listed`);
try {
  await client.completions.create({ model, prompt: 'x', max_tokens: 1000000 });
  throw new Error('an oversized request was accepted');
} catch (e) {
  if (!(e instanceof OpenAI.BadRequestError)) throw e;
}

// the first chunk names the role
const first = await client.chat.completions.create({ ...request, stream: true });
for await (const chunk of first) {
  if (chunk.choices[0]?.delta?.role !== 'assistant') throw new Error(`first chunk without the role: ${JSON.stringify(chunk)}`);
  break;
}

// stop: a piece of the plain answer ends the text right before it, streamed or not
const cut = Math.floor(want.length / 2);
const stop = [...want.slice(cut)].slice(0, 2).join('');
const before = want.slice(0, want.indexOf(stop));
const stopped = await client.chat.completions.create({ ...request, stop: [stop] });
if (stopped.choices[0].message.content !== before || stopped.choices[0].finish_reason !== 'stop')
  throw new Error(`stop ${JSON.stringify(stop)}: ${JSON.stringify(stopped.choices[0])}, want ${JSON.stringify(before)}`);
let streamedStop = '';
let usage = null;
let stopFinish = null;
const s2 = await client.chat.completions.create({ ...request, stop: stop, stream: true,
                                                  stream_options: { include_usage: true } });
for await (const chunk of s2) {
  streamedStop += chunk.choices[0]?.delta?.content ?? '';
  stopFinish = chunk.choices[0]?.finish_reason ?? stopFinish;
  if (chunk.usage) usage = chunk.usage;
}
if (streamedStop !== before || stopFinish !== 'stop')
  throw new Error(`streamed stop: ${JSON.stringify(streamedStop)} (${stopFinish}), want ${JSON.stringify(before)}`);
if (!usage || !(usage.completion_tokens > 0)) throw new Error(`no usage in the stream: ${JSON.stringify(usage)}`);

// n = 2 and logprobs are refused, naming the parameter
for (const [param, extra] of [['n', { n: 2 }], ['logprobs', { logprobs: true }]]) {
  try {
    await client.chat.completions.create({ ...request, ...extra });
    throw new Error(`${param} was accepted`);
  } catch (e) {
    if (!(e instanceof OpenAI.BadRequestError) || e.param !== param) throw e;
  }
}
console.log(`openai client: ${chunks} chunks, finish_reason ${finish}, ${plain.usage.completion_tokens} tokens, ` +
            `streamed text equals the plain answer; 400 on an oversized request; role first; stop ${JSON.stringify(stop)} ` +
            `ends the text (${before.length} characters) streamed or not; usage in the stream ` +
            `(${usage.completion_tokens} tokens); n = 2 and logprobs refused by name`);
