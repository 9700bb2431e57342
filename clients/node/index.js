'use strict';
// The lane ledger's Node client. See README.md.

const { LaneClient, Denied, Completed, CLOSE_JOURNAL_WAIT_MS, DEFAULT_CLOSE_GRACE_MS, DEFAULT_DEADLINE_MS, DEFAULT_END_ATTEMPTS, UNANSWERED_REFUND_ATTEMPTS, UNANSWERED_REFUND_PAUSE_MS } = require('./lib/client');
const { Ending, OUTCOME_TABLE, endingOf, CallNotSent, markNotSent } = require('./lib/outcomes');
const { ledgerPackage } = require('./lib/proto');
const { capNanos, realCostNanos, requestTokens, DEFAULT_BYTES_PER_TOKEN_MILLI } = require('./lib/pricing');
const { usageOf } = require('./lib/usage');
const { ledgerFetch } = require('./lib/providers');
const {
  ContextBudget,
  fitToolResults,
  estimateTokens,
  tokensOfBytes,
  truncationMarker,
  isContextOverflow,
  CONTEXT_OVERFLOW_REPLY,
} = require('./lib/context');
const { OutagePolicy, OutageMode, CallSource, MAX_ALLOWANCE_CALLS } = require('./lib/outage');
const { Journal, JournalError, JournalFull, JournalLocked, Source, ReplayResult, Settlement } = require('./lib/journal');
const { GrantError } = require('./lib/arguments');
const { DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE } = require('./lib/events');

module.exports = {
  LaneClient,
  Denied,
  Completed,
  Ending,
  OUTCOME_TABLE,
  endingOf,
  CallNotSent,
  markNotSent,
  usageOf,
  ledgerFetch,
  ContextBudget,
  fitToolResults,
  estimateTokens,
  tokensOfBytes,
  truncationMarker,
  isContextOverflow,
  CONTEXT_OVERFLOW_REPLY,
  capNanos,
  realCostNanos,
  requestTokens,
  DEFAULT_BYTES_PER_TOKEN_MILLI,
  ledgerPackage,
  CLOSE_JOURNAL_WAIT_MS,
  DEFAULT_CLOSE_GRACE_MS,
  DEFAULT_DEADLINE_MS,
  DEFAULT_END_ATTEMPTS,
  UNANSWERED_REFUND_ATTEMPTS,
  UNANSWERED_REFUND_PAUSE_MS,
  DEFAULT_PAGE_SIZE,
  MAX_PAGE_SIZE,
  OutagePolicy,
  OutageMode,
  CallSource,
  MAX_ALLOWANCE_CALLS,
  Journal,
  JournalError,
  JournalFull,
  JournalLocked,
  Source,
  ReplayResult,
  Settlement,
  GrantError,
  // Re-exported in so many words: Node's ESM import of this CommonJS module
  // finds `...require(...)` (cjs-module-lexer), not a spread variable, so
  // `import { InvalidArgument } from '@lane-ledger/client'` works.
  ...require('./lib/errors'),
};
