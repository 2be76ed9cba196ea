// The official openai client streams a chat completion from a pdmoe server, and the streamed
// text equals the non-streamed answer of the same greedy request. Usage: node openai_stream.mjs URL MODEL
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
console.log(`openai client: ${chunks} chunks, finish_reason ${finish}, ${plain.usage.completion_tokens} tokens, ` +
            `streamed text equals the plain answer; 400 on an oversized request`);
