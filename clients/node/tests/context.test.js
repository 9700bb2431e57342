'use strict';
// The shared context-budgeting cases (clients/cases/context.json), which the
// Python client's clients/python/tests/test_client_context_cases.py runs too: the same inputs,
// the same answers. Pure tests, no server.

const { describe, test } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const {
  CONTEXT_OVERFLOW_REPLY,
  ContextBudget,
  estimateTokens,
  fitToolResults,
  isContextOverflow,
  tokensOfBytes,
  truncationMarker,
} = require('..');

const CASES = JSON.parse(fs.readFileSync(path.join(__dirname, '..', '..', 'cases', 'context.json'), 'utf8'));

/** The cases name things as the Python client does; the Node client's names are camelCase. */
const camelCase = (name) => name.replace(/_([a-z])/g, (_, letter) => letter.toUpperCase());
const budgetOf = (settings = {}) =>
  new ContextBudget(Object.fromEntries(Object.entries(settings).map(([name, value]) => [camelCase(name), value])));

/**
 * A text of the cases: a string, head + repeat x count + tail, or head +
 * repeat repeated and cut to exactly `bytes` bytes with the tail (ASCII).
 */
function textOf(spec) {
  if (typeof spec === 'string') return spec;
  const { head = '', repeat, tail = '' } = spec;
  if (spec.count !== undefined) return head + repeat.repeat(spec.count) + tail;
  assert.ok(/^[\x00-\x7f]*$/.test(head + repeat + tail), 'a text of `bytes` is ASCII');
  const fill = spec.bytes - head.length - tail.length;
  return head + repeat.repeat(Math.floor(fill / repeat.length) + 1).slice(0, fill) + tail;
}

const textsOf = (specs = []) =>
  Array.isArray(specs) ? specs.map(textOf) : Array.from({ length: specs.count }, () => textOf(specs.each));

const named = (kind) => CASES[kind].map((item, index) => [`${index}: ${item.why}`, item]);

test('the defaults and the reply are the shared ones', () => {
  assert.deepEqual({ ...new ContextBudget() }, { ...budgetOf(CASES.defaults) });
  assert.equal(CONTEXT_OVERFLOW_REPLY, CASES.reply);
});

describe('estimates', () => {
  for (const [name, item] of named('estimates')) {
    test(name, () => {
      const milli = item.bytes_per_token_milli ?? CASES.defaults.bytes_per_token_milli;
      const estimate = () =>
        item.text !== undefined ? estimateTokens(textOf(item.text), milli) : tokensOfBytes(item.byte_count, milli);
      if (item.refused) assert.throws(estimate, (error) => error instanceof RangeError || error instanceof TypeError);
      else assert.equal(estimate(), item.tokens);
    });
  }
});

describe('budgets', () => {
  for (const [name, item] of named('budgets')) {
    test(name, () => {
      if (item.refused) assert.throws(() => budgetOf(item.budget), item.refused === 'type' ? TypeError : RangeError);
      else assert.equal(budgetOf(item.budget).inputBudgetTokens, item.input_budget_tokens);
    });
  }
});

function fitOf(item) {
  return fitToolResults(textsOf(item.tool_results), {
    budget: budgetOf(item.budget),
    messages: item.messages_given ?? textsOf(item.messages),
    toolSchemas: item.tool_schemas_given ?? textsOf(item.tool_schemas),
  });
}

function assertToolResult(original, rendered, want) {
  if (want === 'unchanged') {
    assert.equal(rendered, original);
    return;
  }
  const raw = Buffer.from(original, 'utf8');
  // fatal: a kept head that ended inside a character would throw here.
  const head = new TextDecoder('utf-8', { fatal: true }).decode(raw.subarray(0, want.kept_bytes));
  assert.equal(rendered, head + want.marker);
  assert.equal(Buffer.byteLength(rendered, 'utf8'), want.bytes);
  assert.equal(want.marker, truncationMarker(raw.length - want.kept_bytes, raw.length));
}

describe('fitting tool results', () => {
  for (const [name, item] of named('fits')) {
    test(name, () => {
      if (item.refused) {
        const refusal = item.refused === 'type' ? [TypeError] : [RangeError, TypeError];
        assert.throws(() => fitOf(item), (error) => refusal.some((kind) => error instanceof kind));
        return;
      }
      const { expected } = item;
      const fit = fitOf(item);
      assert.deepEqual(
        [fit.fits, fit.iterations, fit.inputTokens, fit.budgetTokens, [...fit.trimmed]],
        [expected.fits, expected.iterations, expected.input_tokens, expected.budget_tokens, expected.trimmed],
      );
      const originals = textsOf(item.tool_results);
      assert.equal(fit.toolResults.length, originals.length);
      assert.equal(expected.tool_results.length, originals.length);
      originals.forEach((original, index) =>
        assertToolResult(original, fit.toolResults[index], expected.tool_results[index]),
      );
      // The same count, made again from what is sent.
      const budget = budgetOf(item.budget);
      const sent = [...textsOf(item.messages), ...textsOf(item.tool_schemas), ...fit.toolResults];
      assert.equal(fit.inputTokens, sent.reduce((sum, text) => sum + budget.tokens(text), 0));
      assert.equal(fit.fits, fit.inputTokens <= fit.budgetTokens);
    });
  }
});

/** The body in each of its forms: the parsed object, its JSON text, its UTF-8. */
function bodiesOf(item) {
  if (item.base64 !== undefined) return [['bytes', Buffer.from(item.base64, 'base64')]];
  const forms = {};
  if (item.text !== undefined) {
    forms.text = textOf(item.text);
  } else {
    forms.object = structuredClone(item.body);
    if (item.set !== undefined) {
      const keys = item.set.path;
      const target = keys.slice(0, -1).reduce((object, key) => object[key], forms.object);
      target[keys.at(-1)] = textOf(item.set.text);
    }
    forms.text = JSON.stringify(forms.object);
  }
  forms.bytes = Buffer.from(forms.text, 'utf8');
  return item.as.map((form) => [form, forms[form]]);
}

describe('recognising an overflow', () => {
  for (const [name, item] of named('overflows')) {
    test(name, () => {
      for (const [form, body] of bodiesOf(item)) {
        assert.equal(isContextOverflow(item.status, body), item.overflow, form);
      }
    });
  }
});

// Not a shared case (yet): the Python client is changed alike, measuring a
// non-string payload as json.dumps(value, separators=(",", ":"),
// ensure_ascii=False) in UTF-8. The byte counts below are what that gives.
describe('payloads that are not text', () => {
  const MESSAGES = [
    [{ role: 'user', content: 'héllo 日本 😀' }, 46],
    [[{ role: 'system', content: 'be brief' }, { role: 'user', content: 'a"b\\c\n' }], 78],
    [{ type: 'function', function: { name: 'f', parameters: { type: 'object', properties: { q: { type: 'string' } }, required: ['q'] } } }, 128],
    [[], 2],
    [{}, 2],
    [42, 2],
    [true, 4],
    [null, 4],
  ];

  test('a message given as an object or an array is measured as its JSON', () => {
    for (const [payload, bytes] of MESSAGES) {
      const json = JSON.stringify(payload);
      assert.equal(Buffer.byteLength(json, 'utf8'), bytes, json);
      assert.equal(estimateTokens(payload), tokensOfBytes(bytes), json);
      assert.equal(estimateTokens(payload, 1000), bytes, json);
      assert.equal(new ContextBudget({ bytesPerTokenMilli: 1000 }).tokens(payload), bytes, json);
      assert.equal(estimateTokens(payload), estimateTokens(json), 'as the text it is sent as');
    }
  });

  test('fitToolResults counts object messages and schemas as the JSON sent', () => {
    const messages = [{ role: 'system', content: 'be brief' }, { role: 'user', content: 'x'.repeat(5000) }];
    const toolSchemas = [MESSAGES[2][0]];
    const results = ['y'.repeat(40_000), 'small'];
    const budget = { maxContextTokens: 8192, reserveOutputTokens: 1024 };
    const asObjects = fitToolResults(results, { budget, messages, toolSchemas });
    const asText = fitToolResults(results, { budget, messages: messages.map((m) => JSON.stringify(m)), toolSchemas: toolSchemas.map((s) => JSON.stringify(s)) });
    assert.deepEqual(asObjects, asText);
    assert.equal(asObjects.fits, true);
    assert.deepEqual([...asObjects.trimmed], [0]);
  });

  test('fitToolResults options it does not take are a TypeError naming them, not the defaults in silence', () => {
    // A ContextBudget given in place of {budget} was read as no budget (the
    // default 16,384-token window), and tools: in place of toolSchemas was
    // never counted: both answered fits: true for results that do not fit.
    const budget = new ContextBudget({ maxContextTokens: 1000, reserveOutputTokens: 100 });
    const large = 'x'.repeat(20_000);
    assert.throws(() => fitToolResults([large], budget), { name: 'TypeError', message: /^fitToolResults\(\) options must be \{budget, messages, toolSchemas\}: give the ContextBudget as \{budget\}/ });
    assert.throws(() => fitToolResults([large], { budget, tools: [large] }), { name: 'TypeError', message: /^fitToolResults\(\) options have no field 'tools'/ });
    assert.throws(() => fitToolResults([large], 'budget'), { name: 'TypeError', message: /^fitToolResults\(\) options must be an object/ });
    assert.equal(fitToolResults([large], { budget, toolSchemas: [large] }).fits, false);
    assert.equal(fitToolResults(['ok']).fits, true);
  });

  test('a value JSON cannot carry, or text with a lone surrogate, is a TypeError', () => {
    const cycle = {};
    cycle.self = cycle;
    for (const payload of [undefined, () => 1, Symbol('s'), 1n, { n: 1n }, cycle, { content: 'a\ud800b' }, { ['\udc00']: 1 }]) {
      assert.throws(() => estimateTokens(payload), TypeError, String(typeof payload));
    }
    assert.throws(() => fitToolResults([], { messages: [undefined] }), TypeError);
  });
});
