// The Responses API with the OpenAI Node SDK: node responses.mjs CASE MODEL
import { zodTextFormat } from 'openai/helpers/zod';
import { z } from 'zod';

import { MODEL, client, main } from './common.mjs';

const openai = client();
const REQUEST = { model: MODEL, input: 'What is the capital of France?', max_output_tokens: 16, temperature: 0 };
// The base model rarely stops on its own: a JSON schema with bounded values ends the answer.
const CITY = {
  type: 'object',
  properties: { city: { type: 'string', enum: ['Paris', 'Lyon', 'Nice'] }, is_capital: { type: 'boolean' } },
  required: ['city', 'is_capital'],
  additionalProperties: false,
};
const DONE = { ...REQUEST, max_output_tokens: 60, text: { format: { type: 'json_schema', name: 'city', schema: CITY, strict: true } } };

function summary(r) {
  return {
    id: r.id,
    object: r.object,
    status: r.status,
    model: r.model,
    output_text: r.output_text,
    output_types: r.output.map((item) => item.type),
    previous_response_id: r.previous_response_id ?? null,
    incomplete_details: r.incomplete_details ?? null,
    usage: r.usage ?? null,
    _request_id: r._request_id ?? null,
  };
}

await main({
  // create, retrieve, continue with previous_response_id, list the conversation's items.
  async create() {
    const first = await openai.responses.create(DONE);
    const again = await openai.responses.retrieve(first.id);
    const next = await openai.responses.create({ ...REQUEST, input: 'And of Italy?', previous_response_id: first.id });
    const items = [];
    for await (const item of openai.responses.inputItems.list(next.id, { order: 'asc' })) items.push(item);
    return {
      first: summary(first),
      retrieved: summary(again),
      next: summary(next),
      items: items.map((item) => ({ type: item.type, role: item.role ?? null })),
    };
  },

  async incomplete() {
    return summary(await openai.responses.create({ ...REQUEST, max_output_tokens: 3 }));
  },

  // stream: true (raw events) and the responses.stream() helper's finalResponse().
  async stream() {
    const events = [];
    for await (const event of await openai.responses.create({ ...DONE, stream: true })) {
      events.push(event);
    }
    const last = events.at(-1);
    const helper = openai.responses.stream(DONE);
    const helperDeltas = [];
    helper.on('response.output_text.delta', (event) => helperDeltas.push(event.delta));
    const final = await helper.finalResponse();
    return {
      types: events.map((e) => e.type),
      sequence_numbers: events.map((e) => e.sequence_number),
      text: events.filter((e) => e.type === 'response.output_text.delta').map((e) => e.delta).join(''),
      done_text: events.find((e) => e.type === 'response.output_text.done')?.text ?? null,
      last: last.response ? summary(last.response) : null,
      helper: summary(final),
      helper_text: helperDeltas.join(''),
    };
  },

  // responses.parse with zodTextFormat: output_parsed.
  async parse() {
    const City = z.object({ city: z.enum(['Paris', 'Lyon', 'Nice']), is_capital: z.boolean() });
    const r = await openai.responses.parse({
      ...REQUEST,
      max_output_tokens: 40,
      text: { format: zodTextFormat(City, 'city') },
    });
    return { ...summary(r), output_parsed: r.output_parsed };
  },

  // A forced function call, and its output sent back with previous_response_id.
  async tools() {
    const tools = [
      {
        type: 'function',
        name: 'get_weather',
        parameters: {
          type: 'object',
          properties: { city: { type: 'string', maxLength: 20 } },
          required: ['city'],
          additionalProperties: false,
        },
        strict: true,
      },
    ];
    const first = await openai.responses.create({
      ...REQUEST,
      max_output_tokens: 40,
      input: 'What is the weather in Paris?',
      tools,
      tool_choice: 'required',
      parallel_tool_calls: false,
    });
    const calls = first.output.filter((item) => item.type === 'function_call');
    const next = await openai.responses.create({
      ...REQUEST,
      previous_response_id: first.id,
      tools,
      input: calls.map((call) => ({ type: 'function_call_output', call_id: call.call_id, output: '22 C' })),
    });
    return {
      first: summary(first),
      calls: calls.map((c) => ({ name: c.name, arguments: c.arguments, call_id: c.call_id, status: c.status ?? null })),
      next: summary(next),
    };
  },
});
