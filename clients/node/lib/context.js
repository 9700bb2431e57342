'use strict';
// Context budgeting, before a lane reserves: the same rules and the
// same answers as the Python client's clients/python/ledger_client/context.py,
// held to them by the cases both test suites run, clients/cases/context.json.
//
// - Tokens are estimated pessimistically from UTF-8 bytes: 3.5 bytes per token
//   by default (JSON tokenizes worse than prose), rounded up. Over-estimating
//   trims a little more than needed; under-estimating is the bug this prevents.
// - Output headroom is withheld from the window, and tool schemas are counted:
//   they are sent on every call.
// - Tool results are fitted largest-first: the largest is cut to the size of
//   the next largest (or only as far as needed), then everything is measured
//   again. One enormous payload is cut; the small useful ones stay identical.
// - A trimmed result says so inside its own content, so the model knows the
//   data is incomplete instead of answering confidently from half of it. A cut
//   keeps whole characters: never part of a UTF-8 sequence, so never half of a
//   JavaScript surrogate pair.
// - Below a floor a result is not cut further. When nothing more can be cut the
//   answer is `fits: false`, after a bounded number of rounds, never a loop.
//
// And when a provider still refuses a request for its size, isContextOverflow
// recognises it, and CONTEXT_OVERFLOW_REPLY is the sentence to show instead of
// the provider's text, which may carry secrets or prompt fragments.
//
// Token and byte counts are plain Numbers, always integers. That is exact for
// counts below 2^53 (Number.MAX_SAFE_INTEGER), far beyond any request; the
// divisions are done in BigInt so that no intermediate product loses a digit,
// and a count that would pass 2^53 is a RangeError rather than a wrong number.

const DEFAULT_BYTES_PER_TOKEN_MILLI = 3500; // 3.5 bytes per token, in thousandths
const BYTES_PER_TOKEN_SCALE = 1000;
const DEFAULT_MAX_CONTEXT_TOKENS = 16_384;
const DEFAULT_RESERVE_OUTPUT_TOKENS = 2_048;
const DEFAULT_MIN_TOOL_RESULT_BYTES = 1_024;
const DEFAULT_MAX_ITERATIONS = 64;
const MAX_TOOL_RESULTS = 1_000;
// Results within this many bytes of the largest are cut as one. A cut lands on
// whole characters (up to 4 bytes of UTF-8) and its marker's count may gain a
// digit, so results cut to one size can differ by a few bytes; cutting each
// down to the next by those few bytes would spend every round on them.
const TIE_BYTES = 8;
const MAX_ERROR_BODY_BYTES = 64 * 1024;
// Real error bodies nest two or three levels; a deeper one is not read.
const MAX_ERROR_BODY_DEPTH = 64;

const CONTEXT_OVERFLOW_REPLY =
  'That question needs more context than the model can take in one request. ' +
  'The model is up and healthy; please ask something narrower, about one part at a time.';

/** ceil(numerator / denominator) of non-negative BigInts, as a safe-integer Number. */
function ceilDiv(numerator, denominator) {
  const quotient = (numerator + denominator - 1n) / denominator;
  if (quotient > BigInt(Number.MAX_SAFE_INTEGER)) throw new RangeError('a count above 2^53 - 1');
  return Number(quotient);
}

function requireInteger(value, name) {
  if (!Number.isSafeInteger(value)) throw new TypeError(`${name} must be a safe integer`);
  return value;
}

/** ceil(byteCount / bytesPerToken), in integers. */
function tokensOfBytes(byteCount, bytesPerTokenMilli = DEFAULT_BYTES_PER_TOKEN_MILLI) {
  requireInteger(byteCount, 'byteCount');
  requireInteger(bytesPerTokenMilli, 'bytesPerTokenMilli');
  if (byteCount < 0 || bytesPerTokenMilli <= 0) {
    throw new RangeError('byteCount must be >= 0 and bytesPerTokenMilli > 0');
  }
  return ceilDiv(BigInt(byteCount) * BigInt(BYTES_PER_TOKEN_SCALE), BigInt(bytesPerTokenMilli));
}

/** The UTF-8 length of a string or of bytes. A lone surrogate has no UTF-8: a TypeError. */
function utf8Length(payload, name) {
  if (typeof payload === 'string') {
    if (!payload.isWellFormed()) throw new TypeError(`${name} is not well-formed text (a lone surrogate)`);
    return Buffer.byteLength(payload, 'utf8');
  }
  if (payload instanceof Uint8Array) return payload.byteLength;
  throw new TypeError(`${name} must be a string or a Uint8Array`);
}

/**
 * The UTF-8 length a payload is measured by: a string's UTF-8, a Uint8Array's
 * bytes, and any other value (a message object, an array of them, a tool
 * schema, a number, a boolean, null) its JSON's: JSON.stringify(value), the
 * way it is sent, never a count of its keys. The Python client's
 * payload_bytes measures json.dumps(value, separators=(",", ":"),
 * ensure_ascii=False) alike: the same bytes for plain objects, arrays,
 * strings, integers, booleans and null. A value JSON cannot carry
 * (undefined, a function, a symbol, a BigInt, a cycle) is a TypeError, and so
 * is text with a lone surrogate anywhere in it (Python cannot encode it).
 */
function payloadLength(payload, name) {
  if (typeof payload === 'string' || payload instanceof Uint8Array) return utf8Length(payload, name);
  let json;
  try {
    json = JSON.stringify(payload, (key, value) => {
      // JSON.stringify escapes a lone surrogate; the Python client cannot encode one: refuse it alike.
      if (!key.isWellFormed() || (typeof value === 'string' && !value.isWellFormed())) {
        throw new TypeError('it holds text that is not well-formed (a lone surrogate)');
      }
      return value;
    });
  } catch (error) {
    if (error instanceof TypeError) throw new TypeError(`${name} cannot be measured as JSON: ${error.message}`);
    throw error;
  }
  if (typeof json !== 'string') throw new TypeError(`${name} cannot be measured as JSON (${typeof payload})`);
  return Buffer.byteLength(json, 'utf8');
}

/**
 * A pessimistic token count for a payload, from its UTF-8 bytes: a string or
 * bytes as they are, any other value as its JSON (see payloadLength).
 */
function estimateTokens(payload, bytesPerTokenMilli = DEFAULT_BYTES_PER_TOKEN_MILLI) {
  return tokensOfBytes(payloadLength(payload, 'payload'), bytesPerTokenMilli);
}

// Each option's default and its bounds (inclusive); maxContextTokens is also
// checked against the reserve.
const BUDGET_OPTIONS = Object.freeze({
  // Must match the served model's window (vLLM's --max-model-len): two
  // statements of one number, and the bug is when they disagree.
  maxContextTokens: [DEFAULT_MAX_CONTEXT_TOKENS, 1, 10 ** 9],
  // Withheld from the input for the reply (the window bounds input + output).
  reserveOutputTokens: [DEFAULT_RESERVE_OUTPUT_TOKENS, 0, 10 ** 9],
  bytesPerTokenMilli: [DEFAULT_BYTES_PER_TOKEN_MILLI, 100, 64_000],
  // Below this a result stops being evidence; it is never cut shorter.
  minToolResultBytes: [DEFAULT_MIN_TOOL_RESULT_BYTES, 256, 10 ** 8],
  maxIterations: [DEFAULT_MAX_ITERATIONS, 1, 10_000],
});

class ContextBudget {
  /**
   * @param {{maxContextTokens?: number, reserveOutputTokens?: number, bytesPerTokenMilli?: number,
   *   minToolResultBytes?: number, maxIterations?: number}} [options]
   */
  constructor(options = {}) {
    for (const name of Object.keys(options)) {
      if (!Object.hasOwn(BUDGET_OPTIONS, name)) throw new TypeError(`unknown context budget option ${name}`);
    }
    for (const [name, [fallback, least, most]] of Object.entries(BUDGET_OPTIONS)) {
      const value = requireInteger(options[name] === undefined ? fallback : options[name], name);
      if (value < least || value > most) throw new RangeError(`${name} must be between ${least} and ${most}`);
      this[name] = value;
    }
    if (this.reserveOutputTokens >= this.maxContextTokens) {
      throw new RangeError('need 0 <= reserveOutputTokens < maxContextTokens <= 10**9');
    }
    Object.freeze(this);
  }

  get inputBudgetTokens() {
    return this.maxContextTokens - this.reserveOutputTokens;
  }

  tokens(payload) {
    return estimateTokens(payload, this.bytesPerTokenMilli);
  }
}

function truncationMarker(removedBytes, originalBytes) {
  return (
    `\n[... truncated ${removedBytes} bytes of ${originalBytes}: this result is ` +
    'incomplete; say what is missing rather than guess it ...]'
  );
}

/** One tool result and how much of it is kept. */
class ToolResult {
  constructor(text, index) {
    if (typeof text !== 'string') throw new TypeError(`tool result ${index} must be a string`);
    utf8Length(text, `tool result ${index}`); // a lone surrogate is refused, as in Python
    this.original = Buffer.from(text, 'utf8');
    this.rendered = text;
    this.sizeBytes = this.original.length;
    this.trimmed = false;
  }

  /** Keeps a head and a marker, together at most sizeBytes long. */
  cutTo(sizeBytes) {
    const total = this.original.length;
    let keep = Math.max(0, sizeBytes - truncationMarker(total, total).length);
    // The marker's length depends on how much it says was removed (it is ASCII:
    // its length is its byte count).
    keep = Math.max(0, sizeBytes - truncationMarker(total - keep, total).length);
    let marker;
    for (;;) {
      // A cut inside a character moves back to the character's first byte: UTF-8
      // continuation bytes are 0b10xxxxxx. So the head is whole code points.
      while (keep > 0 && keep < total && (this.original[keep] & 0xc0) === 0x80) keep -= 1;
      marker = truncationMarker(total - keep, total);
      // Moving back can lengthen the marker's count by a digit: then one byte
      // less, or a cut that lands above its size stalls the fit.
      if (keep + marker.length <= sizeBytes || keep === 0) break;
      keep -= 1;
    }
    this.rendered = this.original.toString('utf8', 0, keep) + marker;
    this.sizeBytes = keep + marker.length;
    this.trimmed = true;
  }
}

const FIT_OPTIONS = new Set(['budget', 'messages', 'toolSchemas']);

/**
 * A ContextBudget given in place of {budget} was read as no budget (the
 * defaults), and a misspelt field (tools for toolSchemas) went uncounted:
 * each answered that results fit which do not.
 */
function checkFitOptions(options) {
  if (options === null || typeof options !== 'object') throw new TypeError('fitToolResults() options must be an object');
  if (options instanceof ContextBudget) {
    throw new TypeError('fitToolResults() options must be {budget, messages, toolSchemas}: give the ContextBudget as {budget}');
  }
  for (const name of Object.keys(options)) {
    if (!FIT_OPTIONS.has(name)) throw new TypeError(`fitToolResults() options have no field '${name}' (budget, messages, toolSchemas)`);
  }
}

/**
 * Fits tool results into what the window leaves after the messages, the tool
 * schemas and the output reserve.
 * @param {string[]} toolResults
 * Each message and tool schema is measured as estimateTokens does: a string or
 * bytes as they are, an object (or any other value) as its JSON.
 * @param {{budget?: ContextBudget|object, messages?: Array<unknown>,
 *   toolSchemas?: Array<unknown>}} [options]
 */
function fitToolResults(toolResults, options = {}) {
  checkFitOptions(options);
  const { budget, messages = [], toolSchemas = [] } = options;
  const settings = budget instanceof ContextBudget ? budget : new ContextBudget(budget ?? {});
  if (!Array.isArray(toolResults)) throw new TypeError('toolResults must be an array of strings');
  if (toolResults.length > MAX_TOOL_RESULTS) throw new RangeError(`at most ${MAX_TOOL_RESULTS} tool results`);
  // One string would be spread as its characters (a token each), one message
  // object not at all: refused, as the Python client does.
  if (!Array.isArray(messages)) throw new TypeError('messages must be an array');
  if (!Array.isArray(toolSchemas)) throw new TypeError('toolSchemas must be an array');
  let fixedTokens = 0;
  for (const text of [...messages, ...toolSchemas]) fixedTokens += settings.tokens(text);
  const results = toolResults.map((text, index) => new ToolResult(text, index));
  // One pass per round: at most maxIterations + 1 passes.
  for (let iterations = 0; ; iterations += 1) {
    let total = fixedTokens;
    for (const result of results) total += tokensOfBytes(result.sizeBytes, settings.bytesPerTokenMilli);
    if (total <= settings.inputBudgetTokens) return fitOf(true, results, total, settings, iterations);
    if (iterations >= settings.maxIterations || !cutLargest(results, total, settings)) {
      return fitOf(false, results, total, settings, iterations);
    }
  }
}

/**
 * Cuts the largest results (all of them if tied, within TIE_BYTES) down to
 * the next largest size, or only as far as the excess needs. false when
 * nothing can be cut.
 */
function cutLargest(results, totalTokens, budget) {
  const floor = budget.minToolResultBytes;
  const cuttable = results.filter((result) => result.sizeBytes > floor);
  if (cuttable.length === 0) return false;
  const top = cuttable.reduce((size, result) => Math.max(size, result.sizeBytes), 0);
  const tied = top - TIE_BYTES;
  const group = cuttable.filter((result) => result.sizeBytes >= tied);
  const nextSize = results.reduce((size, r) => (r.sizeBytes < tied ? Math.max(size, r.sizeBytes) : size), 0);
  const excessTokens = BigInt(totalTokens - budget.inputBudgetTokens);
  const excessBytes = ceilDiv(excessTokens * BigInt(budget.bytesPerTokenMilli), BigInt(BYTES_PER_TOKEN_SCALE));
  const share = ceilDiv(BigInt(excessBytes), BigInt(group.length));
  const newSize = Math.max(nextSize, top - share, floor);
  for (const result of group) {
    if (result.sizeBytes > newSize) result.cutTo(newSize); // never give back what a cut took
  }
  return true;
}

function fitOf(fits, results, total, budget, iterations) {
  const trimmed = results.flatMap((result, index) => (result.trimmed ? [index] : []));
  return Object.freeze({
    fits,
    // The tool results to send, in their original order.
    toolResults: Object.freeze(results.map((result) => result.rendered)),
    // Indexes of the results that were trimmed (and carry a marker).
    trimmed: Object.freeze(trimmed),
    // Estimated input tokens (messages + tool schemas + results) and the budget.
    inputTokens: total,
    budgetTokens: budget.inputBudgetTokens,
    iterations,
  });
}

// Overflow recognition ---------------------------------------------------------

const OVERFLOW_HTTP_STATUSES = new Set([400, 413]);
// Error codes that name the overflow outright (OpenAI and compatible servers).
const OVERFLOW_CODES = new Set(['context_length_exceeded', 'context_window_exceeded']);
// Error types for "your request is wrong", which need the message to say why.
const REQUEST_ERROR_TYPES = new Set(['invalid_request_error', 'badrequesterror', 'invalid_argument', 'request_too_large']);
// Without the u flag, /i folds case in ASCII only for this pattern (a dotless
// i is not an i), as the Python client's re.IGNORECASE | re.ASCII does. The
// last phrase is vLLM's V1 engine: "The decoder prompt (length N) is longer
// than the maximum model length of M."
const OVERFLOW_MESSAGE = new RegExp(
  'context[ _-]?length|context[ _-]?window|maximum context|too many tokens|' +
    'prompt is too long|input is too long|maximum number of tokens|exceeds? the token limit|' +
    'maximum model length',
  'i',
);

const isObject = (value) =>
  value !== null &&
  typeof value === 'object' &&
  !Array.isArray(value) &&
  !ArrayBuffer.isView(value) &&
  !(value instanceof ArrayBuffer);

const fieldOf = (fields, key) => (Object.hasOwn(fields, key) ? fields[key] : undefined);

/** The body and its nested `error` object: providers put the fields in either. */
function errorFields(body) {
  const nested = fieldOf(body, 'error');
  return isObject(nested) ? [body, nested] : [body];
}

/**
 * Whether arrays and objects nest deeper than MAX_ERROR_BODY_DEPTH (string
 * contents skipped). JSON.parse would cope, but Python's parser recurses, and
 * both clients must give one answer.
 */
function nestsTooDeep(text) {
  let depth = 0;
  let inString = false;
  let escaped = false;
  for (const char of text) {
    if (inString) {
      if (escaped) escaped = false;
      else if (char === '\\') escaped = true;
      else if (char === '"') inString = false;
    } else if (char === '"') {
      inString = true;
    } else if (char === '[' || char === '{') {
      depth += 1;
      if (depth > MAX_ERROR_BODY_DEPTH) return true;
    } else if (char === ']' || char === '}') {
      depth -= 1;
    }
  }
  return false;
}

/** The text of a body given as a string or as bytes (UTF-8), a leading byte order mark skipped; or null. */
function textOf(body) {
  if (typeof body === 'string') {
    // Text that cannot be UTF-8 (a lone surrogate) is not a body either.
    if (!body.isWellFormed() || Buffer.byteLength(body, 'utf8') > MAX_ERROR_BODY_BYTES) return null;
    return body.startsWith('\ufeff') ? body.slice(1) : body;
  }
  if (!(body instanceof Uint8Array) && !(body instanceof ArrayBuffer)) return null;
  const bytes = body instanceof ArrayBuffer ? new Uint8Array(body) : body;
  if (bytes.byteLength > MAX_ERROR_BODY_BYTES) return null;
  try {
    // fatal: bytes that are not UTF-8 throw; the decoder skips a leading byte order mark.
    return new TextDecoder('utf-8', { fatal: true }).decode(bytes);
  } catch {
    return null;
  }
}

/**
 * A body as strict JSON (RFC 8259): UTF-8 only, at most MAX_ERROR_BODY_BYTES
 * and MAX_ERROR_BODY_DEPTH, an object at the top. Anything else is no body.
 */
function parsedBody(body) {
  if (body === null || body === undefined || isObject(body)) return body ?? null;
  const text = textOf(body);
  if (text === null || nestsTooDeep(text)) return null;
  let value;
  try {
    value = JSON.parse(text);
  } catch {
    return null;
  }
  return isObject(value) ? value : null;
}

/** The first `count` characters (code points, as Python counts them) of a text. */
function headOfCodePoints(text, count) {
  if (text.length <= count) return text;
  let end = 0;
  for (let points = 0; points < count && end < text.length; points += 1) {
    end += text.codePointAt(end) > 0xffff ? 2 : 1;
  }
  return text.slice(0, end);
}

function kindsOf(fields) {
  return ['type', 'status']
    .map((key) => fieldOf(fields, key))
    .filter((kind) => typeof kind === 'string')
    .map((kind) => kind.toLowerCase());
}

/**
 * Whether a provider refused a request for not fitting its context window.
 *
 * Reads the status and the error's code and type fields; the message is read
 * only to tell an overflow from other bad requests of the same type, and is
 * never shown to anyone (answer with CONTEXT_OVERFLOW_REPLY).
 * @param {number} httpStatus
 * @param {object|string|Uint8Array|ArrayBuffer|null|undefined} body a parsed body, its text or its bytes
 */
function isContextOverflow(httpStatus, body) {
  if (!OVERFLOW_HTTP_STATUSES.has(httpStatus)) return false;
  const parsed = parsedBody(body);
  if (parsed === null) return false;
  for (const fields of errorFields(parsed)) {
    const code = fieldOf(fields, 'code');
    if (typeof code === 'string' && OVERFLOW_CODES.has(code.toLowerCase())) return true;
  }
  for (const fields of errorFields(parsed)) {
    const message = fieldOf(fields, 'message');
    if (
      kindsOf(fields).some((kind) => REQUEST_ERROR_TYPES.has(kind)) &&
      typeof message === 'string' &&
      OVERFLOW_MESSAGE.test(headOfCodePoints(message, MAX_ERROR_BODY_BYTES))
    ) {
      return true;
    }
  }
  return false;
}

module.exports = {
  CONTEXT_OVERFLOW_REPLY,
  DEFAULT_BYTES_PER_TOKEN_MILLI,
  DEFAULT_MAX_CONTEXT_TOKENS,
  DEFAULT_RESERVE_OUTPUT_TOKENS,
  DEFAULT_MIN_TOOL_RESULT_BYTES,
  DEFAULT_MAX_ITERATIONS,
  MAX_TOOL_RESULTS,
  MAX_ERROR_BODY_BYTES,
  MAX_ERROR_BODY_DEPTH,
  ContextBudget,
  tokensOfBytes,
  estimateTokens,
  truncationMarker,
  fitToolResults,
  isContextOverflow,
};
