'use strict';
// The lane ledger's Node client. See README.md.

const { LaneClient, Denied, Completed, DEFAULT_DEADLINE_MS, DEFAULT_END_ATTEMPTS } = require('./lib/client');
const errors = require('./lib/errors');
const { Ending, OUTCOME_TABLE, endingOf, CallNotSent, markNotSent } = require('./lib/outcomes');
const { ledgerPackage } = require('./lib/proto');
const { usageOf } = require('./lib/usage');

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
  ledgerPackage,
  DEFAULT_DEADLINE_MS,
  DEFAULT_END_ATTEMPTS,
  ...errors,
};
