'use strict';
// The README's JavaScript examples: each parses as a script of its own and is
// run by a test as written (the first in ledger.test.js, the openai one in
// openai.test.js, the outage one in outage.test.js, the events one in
// events.test.js, the context one here).

const { after, before, describe, test } = require('node:test');
const assert = require('node:assert/strict');
const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const http = require('node:http');
const os = require('node:os');
const path = require('node:path');
const vm = require('node:vm');
const grpc = require('@grpc/grpc-js');
const { CONTEXT_OVERFLOW_REPLY } = require('..');

const README = fs.readFileSync(path.join(__dirname, '..', 'README.md'), 'utf8');
const BLOCKS = [...README.matchAll(/```js\n([\s\S]*?)```/g)].map((match) => match[1]);
// What tells each example apart, and the test file that runs it.
const RUN_BY = Object.freeze([
  ['async function judge(', 'ledger.test.js'],
  ['ledgerFetch(lane)', 'openai.test.js'],
  ['OutagePolicy.allowance(', 'outage.test.js'],
  ['fitToolResults(', 'readme.test.js'],
  ['lane.watchEvents(', 'events.test.js'],
]);

/** The README's example that contains `marker`. */
function block(marker) {
  const found = BLOCKS.filter((code) => code.includes(marker));
  assert.equal(found.length, 1, `one README example has ${marker}`);
  return found[0];
}

describe('the README examples', () => {
  test('each parses as a script: no top-level return or await', () => {
    assert.ok(BLOCKS.length > 0);
    for (const code of BLOCKS) {
      assert.doesNotThrow(() => new vm.Script(code), code.split('\n').slice(0, 3).join('\n'));
    }
  });

  test('each passes node --check', () => {
    const directory = fs.mkdtempSync(path.join(os.tmpdir(), 'ledger-node-readme-'));
    try {
      BLOCKS.forEach((code, index) => {
        const file = path.join(directory, `example-${index}.js`);
        fs.writeFileSync(file, code);
        execFileSync(process.execPath, ['--check', file], { stdio: 'pipe' });
      });
    } finally {
      fs.rmSync(directory, { recursive: true, force: true });
    }
  });

  test('each is one a test runs (a new one needs its test, and a line in RUN_BY)', () => {
    for (const code of BLOCKS) {
      const runners = RUN_BY.filter(([marker]) => code.includes(marker));
      assert.equal(runners.length, 1, `an example no test runs:\n${code}`);
    }
    assert.equal(BLOCKS.length, RUN_BY.length, 'every example listed is in the README');
  });
});

describe('the context budgeting example', () => {
  let provider;
  const received = [];
  let reply = 'ok';

  before(async () => {
    provider = http.createServer((request, response) => {
      const parts = [];
      request.on('data', (part) => parts.push(part));
      request.on('end', () => {
        received.push(JSON.parse(Buffer.concat(parts).toString('utf8')));
        const json = (status, value) => {
          response.writeHead(status, { 'content-type': 'application/json' });
          response.end(JSON.stringify(value));
        };
        if (reply === 'overflow') {
          json(400, { error: { message: 'maximum context length is 8192 tokens', type: 'invalid_request_error', code: 'context_length_exceeded' } });
        } else if (reply === 'broken') json(500, { error: { message: 'oops' } });
        else json(200, { choices: [{ index: 0, message: { role: 'assistant', content: 'answered' } }] });
      });
    });
    await new Promise((resolve) => provider.listen(0, '127.0.0.1', resolve));
  });

  after(() => provider?.close());

  /** The example as written, its fetch pointed at the local provider. */
  function example() {
    const environment = { env: { PROVIDER_URL: `http://127.0.0.1:${provider.address().port}/v1/chat/completions` } };
    const load = new Function('require', 'process', `${block('fitToolResults(')}\nreturn { answer, budget };`);
    return load((name) => require(name === '@lane-ledger/client' ? '..' : name), environment);
  }

  const SCHEMAS = [{ type: 'function', function: { name: 'search', parameters: { type: 'object', properties: {} } } }];
  const asked = (count) => [
    { role: 'user', content: 'what changed?' },
    { role: 'assistant', content: null, tool_calls: Array.from({ length: count }, (_, index) => ({ id: `call_${index}`, type: 'function', function: { name: 'search', arguments: '{}' } })) },
  ];

  test('results that fit go as they are, a large one is cut, each under its tool call', async () => {
    const { answer } = example();
    reply = 'ok';
    const large = 'x'.repeat(300_000);
    assert.equal(await answer(asked(3), ['first', large, 'third'], SCHEMAS), 'answered');
    const sent = received.at(-1);
    const tools = sent.messages.filter((message) => message.role === 'tool');
    assert.deepEqual(tools.map((message) => message.tool_call_id), ['call_0', 'call_1', 'call_2']);
    assert.equal(tools[0].content, 'first');
    assert.equal(tools[2].content, 'third');
    const cut = tools[1].content;
    assert.ok(cut.length < large.length && cut.startsWith('xxx'), 'the large result is cut');
    assert.ok(/\[\.\.\. truncated \d+ bytes of 300000\b/.test(cut.slice(-200)), cut.slice(-200));
    assert.deepEqual(sent.tools, SCHEMAS);
  });

  test("the provider's overflow and a window the messages overfill give the constant reply; a 500 gives null", async () => {
    const { answer } = example();
    reply = 'overflow';
    assert.equal(await answer(asked(1), ['result'], SCHEMAS), CONTEXT_OVERFLOW_REPLY);
    reply = 'ok';
    const before = received.length;
    const overfull = [{ role: 'user', content: 'y'.repeat(100_000) }, ...asked(1).slice(1)];
    assert.equal(await answer(overfull, ['result'], SCHEMAS), CONTEXT_OVERFLOW_REPLY);
    assert.equal(received.length, before, 'nothing sent');
    reply = 'broken';
    assert.equal(await answer(asked(1), ['result'], SCHEMAS), null);
  });
});

describe('the README says what a lane can rely on', () => {
  const readme = () => fs.readFileSync(path.join(__dirname, '..', 'README.md'), 'utf8').replace(/\s+/g, ' ');

  test("an error's code is the gRPC status as a number", () => {
    const { InvalidArgument, ClientClosed, LedgerError } = require('..');
    assert.match(readme(), /`\.code`, the gRPC status as a number/);
    const error = new InvalidArgument('lane: is required', { code: grpc.status.INVALID_ARGUMENT, reason: 'INVALID_ARGUMENT', field: 'lane' });
    assert.equal(typeof error.code, 'number');
    for (const name of ['code', 'reason', 'message', 'field', 'errorId', 'retryable', 'mayHaveApplied', 'metadata']) {
      assert.ok(readme().includes(`\`.${name}\``), name);
      assert.ok(name in error, name);
    }
    assert.ok(!(new ClientClosed('x') instanceof LedgerError));
  });

  test('close() refuses new calls with ClientClosed and waits up to graceMs', () => {
    const { DEFAULT_CLOSE_GRACE_MS } = require('..');
    assert.equal(DEFAULT_CLOSE_GRACE_MS, 5000);
    assert.match(readme(), /`await ledger\.close\(\{ graceMs \}\)` refuses every new call at once/);
    assert.match(readme(), /`graceMs` \(5000 by default, `DEFAULT_CLOSE_GRACE_MS`/);
    const { CLOSE_JOURNAL_WAIT_MS } = require('..');
    assert.equal(CLOSE_JOURNAL_WAIT_MS, 1000);
    assert.match(readme().replace(/\s+/g, ' '), /at most 1000 ms after the cut-off \(`CLOSE_JOURNAL_WAIT_MS`/);
  });
});
