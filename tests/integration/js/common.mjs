// Shared by the scripts here: each runs one case (argv[2]) with the OpenAI Node SDK against the
// gateway and prints one JSON line of what it saw, for tests/integration/test_openai_js_sdk.py.
// The gateway comes from the SDK's own environment variables (OPENAI_BASE_URL, OPENAI_API_KEY),
// as an app's would; the model from argv[3].
import OpenAI from 'openai';

export const MODEL = process.argv[3] ?? 'base';
export const QUESTION = [{ role: 'user', content: 'What is the capital of France?' }];

export function client(options = {}) {
  return new OpenAI({ maxRetries: 0, timeout: 120_000, ...options });
}

// What the test needs to know of an SDK error: its class, status, body and request id.
export function describeError(err) {
  if (!(err instanceof OpenAI.APIError)) {
    return { class: err?.constructor?.name ?? typeof err, message: String(err?.stack ?? err) };
  }
  return {
    class: err.constructor.name,
    api_error: true,
    not_found: err instanceof OpenAI.NotFoundError,
    bad_request: err instanceof OpenAI.BadRequestError,
    authentication: err instanceof OpenAI.AuthenticationError,
    status: err.status ?? null,
    message: err.message,
    error: err.error ?? null,
    code: err.code ?? null,
    param: err.param ?? null,
    type: err.type ?? null,
    request_id: err.requestID ?? null,
    header_request_id: err.headers?.get?.('x-request-id') ?? null,
  };
}

// Runs cases[argv[2]] and prints its result; an exception becomes {"thrown": ...} (exit 0), so the
// test can assert on errors it expects and show the ones it does not.
export async function main(cases) {
  const name = process.argv[2];
  if (!(name in cases)) {
    console.error(`unknown case ${name}; one of: ${Object.keys(cases).join(', ')}`);
    process.exit(2);
  }
  let result;
  try {
    result = await cases[name]();
  } catch (err) {
    result = { thrown: describeError(err) };
  }
  process.stdout.write('RESULT ' + JSON.stringify(result) + '\n');
}
