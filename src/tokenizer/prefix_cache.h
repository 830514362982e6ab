/*
 * prefix_cache: a prefix token cache in front of tok_encode (seed-features.md section 7,
 * decision 7). Multi-turn clients resend the whole history every turn; the cache keeps the ids
 * of earlier prompts and, for a prompt that extends a cached one, tokenizes only the tail.
 *
 * Units: everything the spec counts in "characters" is counted here in BYTES of UTF-8
 * (max_total_bytes, min_bytes, bucket_bytes, split offsets). A split never falls inside a
 * UTF-8 character.
 *
 * Contract: prefix_cache_encode(pc, text, ...) returns exactly the ids of
 * tok_encode(t, text, ..., add_special, parse_special), byte for byte. When the cache cannot
 * show that a splice is safe it tokenizes in full ("when in doubt, miss"); a failure inside
 * the cache (allocation, an unverifiable alignment) falls back to plain tokenization and never
 * fails the call beyond what tok_encode itself can return.
 *
 *   cached entry E (text P, ids A = tok_encode(P)):
 *
 *     P:  |-------------- prefix ---------------|#######  overlap (>= 64 tokens) ######|
 *     A:  [ A[0] ............. A[split-1] ]     [ A[split] ... A[n-1] ]
 *                                           ^ split_byte: start of token A[split]
 *   new prompt T = P + more:
 *     T:  |-------------- prefix ---------------|######## tail: re-tokenized ####################|
 *     ids = A[0..split) + tok_encode(T[split_byte..], add_special = false)
 *           accepted only if the first `resync` tail ids equal A[split .. split+resync)
 *           (and the tail's token bytes spell T[split_byte..] exactly); otherwise a full
 *           tok_encode(T) (a miss and a resync failure).
 *
 * Split points. An entry's split token is the last "eligible" token at or before
 * n - overlap: its start offset is known exactly (token bytes through tok_token_bytes), it is
 * not a special token, and it does not start inside a UTF-8 character. With strict_split (the
 * default) it must also start a word: the token's bytes are " " + an ASCII letter and the byte
 * before it is not whitespace. For the pre-tokenizers kvserve supports (GPT-2 / Llama-3 /
 * Qwen regexes, SentencePiece whitespace splitting) such a position is a pre-token boundary
 * whatever text precedes or follows, so the tail tokenizes independently of the prefix; the
 * resync check is then a second guard. With strict_split = false the split is exactly the
 * spec's (token n - overlap, if eligible) and only the resync check guards it.
 * Tokenizers with a SentencePiece dummy prefix ("Hello" -> "▁Hello") re-tokenize the tail
 * from the byte after the split's space, which the dummy prefix restores.
 *
 * Keys: entries are bucketed by a hash of (add_special, parse_special, the first bucket_bytes
 * bytes); a lookup takes the longest entry with the same options whose text is a byte prefix
 * of the prompt. The cache is bound to one tokenizer.
 *
 * Insertion: after every looked-up prompt of at least bucket_bytes bytes, unless it repeats
 * the matched entry exactly (an exact repeat is answered from the entry, no tokenization) or
 * an equal entry exists; the matched shorter entry stays. Eviction: least recently used
 * (lookups move an entry to the front) while entries > max_entries or stored text bytes >
 * max_total_bytes.
 *
 * Thread safety: any number of threads may call prefix_cache_encode at once; one mutex guards
 * the index and the counters, tokenization runs outside it (entries are immutable and
 * reference counted while in use).
 *
 * Example:
 *   struct prefix_cache_config c; prefix_cache_config_default(&c);
 *   prefix_cache_t *pc; char err[256];
 *   if (prefix_cache_new(t, &c, &pc, err, sizeof err)) { ... err names the bad setting ... }
 *   prefix_cache_encode(pc, text, len, true, true, &ids, &n);   // == tok_encode's ids
 *   prefix_cache_free(pc);
 */
#ifndef KV_TOKENIZER_PREFIX_CACHE_H
#define KV_TOKENIZER_PREFIX_CACHE_H

#include "tokenizer.h"

typedef struct prefix_cache prefix_cache_t;

struct prefix_cache_config {
    size_t max_entries;     /* default 512; > 0 */
    size_t max_total_bytes; /* default 64 MiB of stored prompt text; > 0 */
    size_t overlap_tokens;  /* default 64; > 0: tokens re-tokenized before the new text */
    size_t resync_tokens;   /* default 32; > 0 and <= overlap_tokens */
    size_t min_bytes;       /* default 4096; shorter prompts bypass the cache (counters untouched) */
    size_t bucket_bytes;    /* default 2048; > 0; prompts shorter than this are never stored */
    bool strict_split;      /* default true: split only where a word starts (see above) */
};

void prefix_cache_config_default(struct prefix_cache_config *c);
/* KV_OK, or KV_EINVAL with a message naming the setting and the rule it breaks. */
kv_status prefix_cache_config_validate(const struct prefix_cache_config *c, char *err,
                                       size_t errlen);

/* Creates a cache for tokenizer t (borrowed: must outlive the cache). Probes t once (token
 * byte table, BOS/suffix ids, dummy prefix). KV_EINVAL for invalid settings (message in err),
 * KV_ENOMEM. *out untouched on failure. */
kv_status prefix_cache_new(const tokenizer_t *t, const struct prefix_cache_config *c,
                           prefix_cache_t **out, char *err, size_t errlen);
void prefix_cache_free(prefix_cache_t *pc);

/* Same contract and result as tok_encode(pc's tokenizer, text, len, add_special,
 * parse_special, ids, n_ids): *ids heap-allocated (caller frees). Errors are tok_encode's
 * (KV_EINVAL for bad arguments, KV_ENOMEM), with *ids untouched. */
kv_status prefix_cache_encode(prefix_cache_t *pc, const char *text, size_t len, bool add_special,
                              bool parse_special, int32_t **ids, size_t *n_ids);

struct prefix_cache_stats {
    uint64_t hits;             /* prompts answered from an entry (+ tail) */
    uint64_t misses;           /* looked-up prompts tokenized in full (incl. resync failures) */
    uint64_t resync_failures;  /* a splice was tried and rejected */
    uint64_t errors;           /* internal failures that fell back to plain tokenization */
    uint64_t inserts, evictions;
    uint64_t entries;          /* now */
    uint64_t total_bytes;      /* stored prompt text bytes now */
};
void prefix_cache_get_stats(prefix_cache_t *pc, struct prefix_cache_stats *s);
const struct prefix_cache_config *prefix_cache_get_config(const prefix_cache_t *pc);

#endif
