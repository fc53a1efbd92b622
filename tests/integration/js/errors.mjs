// Errors as the OpenAI Node SDK raises them: node errors.mjs CASE MODEL
// Each case expects a throw; main() prints it as {"thrown": ...}. Returning is the failure.
import { MODEL, QUESTION, client, main } from './common.mjs';

const openai = client();

await main({
  async unknown_model() {
    return openai.chat.completions.create({ model: 'no-such-adapter', messages: QUESTION });
  },

  // The gateway's x-request-id, one the client chose, on the error.
  async unknown_model_with_id() {
    return openai.chat.completions.create(
      { model: 'no-such-adapter', messages: QUESTION },
      { headers: { 'x-request-id': 'js-sdk-error-1' } },
    );
  },

  async bad_param() {
    return openai.chat.completions.create({ model: MODEL, messages: QUESTION, temperature: 5 });
  },

  // A 400 before any byte of a stream: the SDK raises it from create(), not mid-iteration.
  async bad_param_stream() {
    const stream = await openai.chat.completions.create({ model: MODEL, messages: QUESTION, temperature: 5, stream: true });
    for await (const _ of stream);
    return { streamed: true };
  },

  async bad_param_responses() {
    return openai.responses.create({ model: MODEL, input: 'Hi', temperature: 5 });
  },

  async bad_key() {
    return client({ apiKey: 'sk-not-a-key' }).models.list();
  },

  async unknown_response() {
    return openai.responses.retrieve('resp_doesnotexist');
  },
});
