'use strict';
// A provider's usage block, read into the client's usage: the same rules as
// the Python client's usage_of (clients/python/ledger_client/usage.py).
//
// The ledger's convention: `inputTokens` counts EVERY input token (the cached
// and cache-write ones are parts of it) and `outputTokens` every output token,
// reasoning tokens included. Providers count differently:
// - OpenAI chat completions: `prompt_tokens` already counts every input token,
//   `prompt_tokens_details.cached_tokens` is the cached part of it,
//   `prompt_tokens_details.cache_write_tokens` the part written to the cache, and
//   `completion_tokens` already counts `completion_tokens_details.reasoning_tokens`
//   (not added again). Its Responses API counts the same way as `input_tokens`,
//   `input_tokens_details.cached_tokens` / `.cache_write_tokens`, `output_tokens`.
// - Anthropic messages: `input_tokens` EXCLUDES the cache, so the input is
//   input_tokens + cache_read_input_tokens + cache_creation_input_tokens; the
//   cached part is cache_read_input_tokens, the written part
//   cache_creation_input_tokens; output_tokens is taken as it is.
// A missing or null count is 0; a count above MAX_TOKENS (10^12, the ledger's
// bound, as the Python client's Usage) is refused. A block with no input token
// at all is no evidence of a billed call (the ledger refuses such a SUCCEEDED
// settle), so it reads as no usage: the call is then charged at its hold.

const { MAX_TOKENS } = require('./journal');

const isObject = (value) => value !== null && typeof value === 'object' && !Array.isArray(value);

/** A token count as a BigInt: an integer from 0 to MAX_TOKENS; missing or null is 0n. */
function count(block, key) {
  const value = block[key];
  if (value === undefined || value === null) return 0n;
  if (!Number.isSafeInteger(value) || value < 0) {
    throw new TypeError(`usage ${key} is not a non-negative integer`);
  }
  return bounded(BigInt(value), key);
}

/** A count the ledger can take: at most MAX_TOKENS, else a RangeError. */
function bounded(tokens, name) {
  if (tokens > MAX_TOKENS) throw new RangeError(`usage ${name} is more than ${MAX_TOKENS} tokens`);
  return tokens;
}

function detailsOf(block, key) {
  const details = block[key];
  if (details === undefined || details === null) return {};
  if (!isObject(details)) throw new TypeError(`usage ${key} is not an object`);
  return details;
}

function openAiStyle(block, inputKey, detailsKey, outputKey) {
  const inputTokens = count(block, inputKey);
  const details = detailsOf(block, detailsKey);
  const cachedInputTokens = count(details, 'cached_tokens');
  const cacheWriteTokens = count(details, 'cache_write_tokens');
  if (cachedInputTokens + cacheWriteTokens > inputTokens) {
    throw new RangeError(`usage cached_tokens and cache_write_tokens are more than ${inputKey}`);
  }
  return { inputTokens, outputTokens: count(block, outputKey), cachedInputTokens, cacheWriteTokens };
}

function anthropicStyle(block) {
  const cachedInputTokens = count(block, 'cache_read_input_tokens');
  const cacheWriteTokens = count(block, 'cache_creation_input_tokens');
  return {
    // Each part within the bound, and their sum too (the ledger's input_tokens).
    inputTokens: bounded(count(block, 'input_tokens') + cachedInputTokens + cacheWriteTokens, 'input_tokens with the cache'),
    outputTokens: count(block, 'output_tokens'),
    cachedInputTokens,
    cacheWriteTokens,
  };
}

function readBlock(block) {
  if ('prompt_tokens' in block) return openAiStyle(block, 'prompt_tokens', 'prompt_tokens_details', 'completion_tokens');
  // OpenAI Responses: its input_tokens counts the cache.
  if ('input_tokens_details' in block) return openAiStyle(block, 'input_tokens', 'input_tokens_details', 'output_tokens');
  // Anthropic: its input_tokens excludes the cache.
  if ('input_tokens' in block) return anthropicStyle(block);
  return null;
}

/**
 * The usage of a provider's parsed response body (its `usage` object; the
 * usage object itself is taken too), as BigInts, or null when it reports none.
 * Throws TypeError for a count that is not a non-negative integer, RangeError
 * for one above MAX_TOKENS (10^12) or cached and cache-write tokens above the input.
 * @param {object|null|undefined} body
 * @returns {import('../index').ProviderUsage|null}
 */
function usageOf(body) {
  if (!isObject(body)) return null;
  const block = 'usage' in body ? body.usage : body;
  if (!isObject(block)) return null;
  const usage = readBlock(block);
  return usage === null || usage.inputTokens === 0n ? null : usage;
}

module.exports = { usageOf };
