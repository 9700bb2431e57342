'use strict';
const { randomBytes } = require('node:crypto');
// W3C trace context for the ledger's calls. The ledger starts a SERVER span
// for every RPC as a child of the `traceparent` that came in, and stores that
// span's trace id on every event the call writes (Event.trace_id): so a lane
// that sends its trace context finds its own trace id on its bookings.
//
// Which context a call carries: an explicit, valid `traceparent` given to the
// call wins; otherwise the active OpenTelemetry context, when the optional peer
// `@opentelemetry/api` is installed and the application registered a
// propagator; otherwise none (the ledger then starts a trace of its own).

// `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`, lowercase; version
// 00 only, so the length is exact (W3C Trace Context, level 1).
const TRACEPARENT = /^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$/;
const ZERO_TRACE_ID = '0'.repeat(32);
const ZERO_PARENT_ID = '0'.repeat(16);
// The W3C limit is 32 list members; 512 characters is what propagators keep.
const MAX_TRACESTATE_LENGTH = 512;
// Printable ASCII only: gRPC metadata values may not hold anything else.
const TRACESTATE = /^[\x20-\x7e]*$/;

/** The W3C trace id of a valid traceparent; null when it is not one. */
function traceIdOf(traceparent) {
  if (typeof traceparent !== 'string') return null;
  const match = TRACEPARENT.exec(traceparent);
  if (match === null || match[1] === ZERO_TRACE_ID || match[2] === ZERO_PARENT_ID) return null;
  return match[1];
}

function isValidTraceparent(traceparent) {
  return traceIdOf(traceparent) !== null;
}

function isValidTracestate(tracestate) {
  return (
    typeof tracestate === 'string' &&
    tracestate.length > 0 &&
    tracestate.length <= MAX_TRACESTATE_LENGTH &&
    TRACESTATE.test(tracestate)
  );
}

let otelApi;
/** `@opentelemetry/api`, or null when it is not installed (looked for once). */
function openTelemetry() {
  if (otelApi === undefined) {
    try {
      otelApi = require('@opentelemetry/api');
    } catch {
      otelApi = null;
    }
  }
  return otelApi;
}

/** The headers from an explicit traceparent (and tracestate), or null when it is not valid. */
function explicitHeaders(traceparent, tracestate) {
  if (!isValidTraceparent(traceparent)) return null;
  const headers = { traceparent };
  if (isValidTracestate(tracestate)) headers.tracestate = tracestate;
  return headers;
}

/** The headers of the active OpenTelemetry context, or null when there is none. */
function activeHeaders() {
  const api = openTelemetry();
  if (api === null) return null;
  const carrier = {};
  try {
    api.propagation.inject(api.context.active(), carrier);
  } catch {
    // A failing propagator must never fail a ledger call.
    return null;
  }
  return explicitHeaders(carrier.traceparent, carrier.tracestate);
}

/**
 * The trace headers a call sends: `{traceparent, tracestate?}`, or null.
 * @param {{traceparent?: string, tracestate?: string}} [options]
 */
function traceHeaders(options) {
  return explicitHeaders(options?.traceparent, options?.tracestate) ?? activeHeaders();
}

/**
 * Headers of a new trace, for a call() given no context: its Reserve and its
 * Settle or Refund then share one trace id, as the Python client's do.
 */
function freshTraceHeaders() {
  return { traceparent: `00-${randomBytes(16).toString('hex')}-${randomBytes(8).toString('hex')}-01` };
}

/** Puts the headers on gRPC metadata, replacing any there. */
function setTraceHeaders(metadata, headers) {
  if (headers === null || headers === undefined) return;
  metadata.set('traceparent', headers.traceparent);
  if (headers.tracestate !== undefined) metadata.set('tracestate', headers.tracestate);
  else metadata.remove('tracestate');
}

module.exports = { traceHeaders, freshTraceHeaders, setTraceHeaders, traceIdOf, isValidTraceparent, openTelemetry };
