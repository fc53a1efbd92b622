// Chat completions, text completions and models with the OpenAI Node SDK: node chat.mjs CASE MODEL
import { zodFunction, zodResponseFormat } from 'openai/helpers/zod';
import { z } from 'zod';

import { MODEL, QUESTION, client, main } from './common.mjs';

const openai = client();
const GREEDY = { model: MODEL, messages: QUESTION, max_tokens: 12, temperature: 0 };
const WEATHER = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'The weather in a city.',
    parameters: {
      type: 'object',
      properties: { city: { type: 'string', maxLength: 20 } },
      required: ['city'],
      additionalProperties: false,
    },
  },
};
const CITY_SCHEMA = {
  type: 'object',
  properties: { city: { type: 'string', enum: ['Paris', 'Lyon', 'Nice'] }, is_capital: { type: 'boolean' } },
  required: ['city', 'is_capital'],
  additionalProperties: false,
};

function summary(completion) {
  const choice = completion.choices[0];
  return {
    id: completion.id,
    object: completion.object,
    model: completion.model,
    created: completion.created,
    role: choice.message.role,
    content: choice.message.content,
    tool_calls: choice.message.tool_calls ?? null,
    finish_reason: choice.finish_reason,
    usage: completion.usage ?? null,
  };
}

await main({
  // One answer, with the response's headers (.withResponse) and the SDK's _request_id.
  async create() {
    const { data, response, request_id } = await openai.chat.completions
      .create(GREEDY, { headers: { 'x-request-id': 'js-sdk-create-1' } })
      .withResponse();
    return {
      ...summary(data),
      _request_id: data._request_id,
      request_id,
      x_adapter: response.headers.get('x-adapter'),
      x_adapter_digest: response.headers.get('x-adapter-digest'),
    };
  },

  // stream: true, iterated with for await, against the same request answered whole.
  async stream() {
    const whole = await openai.chat.completions.create(GREEDY);
    const stream = await openai.chat.completions.create({
      ...GREEDY,
      stream: true,
      stream_options: { include_usage: true },
    });
    const chunks = [];
    for await (const chunk of stream) chunks.push(chunk);
    const withChoices = chunks.filter((c) => c.choices.length);
    return {
      whole: summary(whole),
      text: withChoices.map((c) => c.choices[0].delta.content ?? '').join(''),
      content_chunks: withChoices.filter((c) => c.choices[0].delta.content).length,
      roles: withChoices.map((c) => c.choices[0].delta.role).filter(Boolean),
      finish_reasons: withChoices.map((c) => c.choices[0].finish_reason).filter(Boolean),
      ids: [...new Set(chunks.map((c) => c.id))],
      objects: [...new Set(chunks.map((c) => c.object))],
      models: [...new Set(chunks.map((c) => c.model))],
      last_usage: chunks.at(-1).usage ?? null,
      last_choices: chunks.at(-1).choices.length,
    };
  },

  // client.chat.completions.stream(): the helper's events and finalChatCompletion().
  async stream_helper() {
    const stream = openai.chat.completions.stream(GREEDY);
    const deltas = [];
    let snapshot = '';
    stream.on('content', (delta, snap) => {
      deltas.push(delta);
      snapshot = snap;
    });
    const final = await stream.finalChatCompletion();
    return { final: summary(final), deltas, snapshot, final_content: await stream.finalContent() };
  },

  async json_schema() {
    const r = await openai.chat.completions.create({
      ...GREEDY,
      max_tokens: 40,
      response_format: { type: 'json_schema', json_schema: { name: 'city', schema: CITY_SCHEMA, strict: true } },
    });
    return summary(r);
  },

  // chat.completions.parse with zodResponseFormat: the SDK parses the answer into message.parsed.
  async parse() {
    const City = z.object({ city: z.enum(['Paris', 'Lyon', 'Nice']), is_capital: z.boolean() });
    const r = await openai.chat.completions.parse({
      ...GREEDY,
      max_tokens: 40,
      response_format: zodResponseFormat(City, 'city'),
    });
    return { ...summary(r), parsed: r.choices[0].message.parsed, refusal: r.choices[0].message.refusal ?? null };
  },

  // tool_choice: required, then the SDK's own history (the call, a tool message) sent back.
  async tools_required() {
    const request = {
      ...GREEDY,
      max_tokens: 40,
      messages: [{ role: 'user', content: 'What is the weather in Paris?' }],
      tools: [WEATHER],
      tool_choice: 'required',
      parallel_tool_calls: false, // one call: the base model repeats calls until max_tokens
    };
    const first = await openai.chat.completions.create(request);
    const message = first.choices[0].message;
    const next = await openai.chat.completions.create({
      ...request,
      tool_choice: 'none',
      messages: [
        ...request.messages,
        message,
        ...message.tool_calls.map((call) => ({ role: 'tool', tool_call_id: call.id, content: '22 C and sunny' })),
      ],
    });
    return { first: summary(first), next: summary(next) };
  },

  // The stream helper assembling a forced call, and runTools calling a zodFunction.
  async tools_helpers() {
    const stream = openai.chat.completions.stream({
      ...GREEDY,
      max_tokens: 40,
      messages: [{ role: 'user', content: 'What is the weather in Paris?' }],
      tools: [WEATHER],
      tool_choice: { type: 'function', function: { name: 'get_weather' } },
    });
    const argumentDeltas = [];
    stream.on('tool_calls.function.arguments.delta', (event) => argumentDeltas.push(event.arguments_delta));
    const doneEvents = [];
    stream.on('tool_calls.function.arguments.done', (event) => doneEvents.push(event.arguments));
    const streamed = await stream.finalChatCompletion();

    const calls = [];
    const runner = openai.chat.completions.runTools({
      ...GREEDY,
      max_tokens: 40,
      messages: [{ role: 'user', content: 'What is the weather in Paris?' }],
      tools: [
        zodFunction({
          name: 'get_weather',
          parameters: z.object({ city: z.string().max(20) }),
          function: (args) => {
            calls.push(args);
            return { temperature_c: 22 };
          },
        }),
      ],
      tool_choice: { type: 'function', function: { name: 'get_weather' } },
    });
    await runner.done();
    return {
      streamed: summary(streamed),
      argument_deltas: argumentDeltas,
      done_arguments: doneEvents,
      run_calls: calls,
      run_messages: runner.messages.map((m) => ({
        role: m.role,
        tool_call_id: m.tool_call_id ?? null,
        tool_call_ids: m.tool_calls?.map((call) => call.id) ?? null,
        content: m.content ?? null,
      })),
      final_call: (await runner.finalFunctionToolCall()) ?? null,
    };
  },

  async completions() {
    const request = { model: MODEL, prompt: 'The capital of France is', max_tokens: 8, temperature: 0 };
    const whole = await openai.completions.create(request);
    const chunks = [];
    for await (const chunk of await openai.completions.create({ ...request, stream: true })) chunks.push(chunk);
    return {
      id: whole.id,
      object: whole.object,
      model: whole.model,
      text: whole.choices[0].text,
      finish_reason: whole.choices[0].finish_reason,
      usage: whole.usage,
      streamed_text: chunks.filter((c) => c.choices.length).map((c) => c.choices[0].text).join(''),
      stream_objects: [...new Set(chunks.map((c) => c.object))],
      chunks: chunks.length,
    };
  },

  // models.list(): iterated (the SDK's auto-pagination) and as a page; models.retrieve().
  async models() {
    const ids = [];
    for await (const model of openai.models.list()) ids.push(model.id);
    const page = await openai.models.list();
    const shout = await openai.models.retrieve('shout');
    return {
      ids,
      page_ids: page.data.map((m) => m.id),
      has_next_page: page.hasNextPage(),
      shout: { id: shout.id, object: shout.object, owned_by: shout.owned_by, parent: shout.parent ?? null },
    };
  },
});
