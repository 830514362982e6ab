/*
 * grammar: constrained decoding. JSON schemas, regular expressions, choice lists and GBNF
 * grammars are compiled into one representation (a context-free grammar over bytes); a
 * matcher per sequence tracks where the output is in that grammar and gives, before each
 * token, the set of vocabulary tokens that keep the output inside it.
 *
 *   gram_compile_*(source) --> gram_t (immutable, shared, refcounted; compiled grammars are
 *                              cached by source, so a repeated schema costs a lookup)
 *   gram_vocab_new(tokenizer) --> gram_vocab_t (per tokenizer: every token's output bytes in a
 *                              byte trie; built once)
 *   gram_matcher_new(g, vocab) --> per sequence:  mask() -> allowed token bitset
 *                                                 accept(token) -> advance
 *
 * Masks: a matcher state is a set of parser stacks (a pushdown recognizer, tail calls
 * folded). The allowed set of a state is computed by walking the vocabulary trie once,
 * advancing the state byte by byte and pruning a subtree as soon as no stack survives. Masks
 * are cached per (grammar, vocabulary, state), so states that recur (inside a string, between
 * array items, across requests with the same schema) cost a hash lookup and a copy.
 *
 * What a token contributes is tok_token_bytes() (its bytes as a continuation of the output):
 * the grammar constrains exactly the text the API returns. Special tokens (control tokens,
 * skipped in the output) are never allowed, except the end-of-generation ids, which are
 * allowed exactly when the grammar is complete.
 *
 * Safety: a token is in the mask only if every byte of it was consumed by the recognizer,
 * so sampling from the mask can never leave the grammar; limits (stack depth
 * GRAM_MAX_DEPTH, stacks per state GRAM_MAX_STACKS) can only remove tokens from a mask.
 *
 * Cost bounds (a pathological constraint must not slow other requests): nested quantifiers
 * are merged where exact ((x*)* == x*), literal alternatives become a trie, a grammar that
 * reaches GRAM_MAX_STACKS parses on the most ambiguous path the compiler explores is refused
 * (KV_ETOOLONG), and a mask that needs more than its work budget fails (gram_matcher_mask).
 *
 * Thread safety: gram_t and gram_vocab_t are immutable after creation and may be shared by
 * any number of threads (the mask cache inside a gram_t has its own lock). A matcher belongs
 * to one sequence and one thread at a time.
 *
 * Supported inputs and their limits: docs/structured-output.md.
 */
#ifndef KV_GRAMMAR_H
#define KV_GRAMMAR_H

#include <jansson.h>

#include "../base/base.h"
#include "../tokenizer/tokenizer.h"

typedef struct gram gram_t;
typedef struct gram_vocab gram_vocab_t;
typedef struct gram_matcher gram_matcher_t;

/* ---------------------------------------------------------------- compiling
 * Every compile function returns KV_OK with *out holding one reference (release with
 * gram_unref), or an error with *out untouched and a message in err naming what is not
 * supported (e.g. "unsupported JSON schema keyword 'patternProperties' at #/properties/a"):
 * KV_EINVAL (bad or unsupported input), KV_ETOOLONG (the grammar would exceed the size
 * limits), KV_ENOMEM. Compiled grammars are kept in a small LRU keyed by kind and source. */

/* JSON schema (draft 2020-12 subset). strict: properties not listed are never generated
 * (OpenAI strict mode; additionalProperties absent means false); !strict: an object schema
 * without properties and without additionalProperties: false admits any members. */
kv_status gram_compile_json_schema(const json_t *schema, bool strict, gram_t **out, char *err,
                                   size_t errlen);
/* Any JSON object (response_format json_object). */
kv_status gram_compile_json_object(gram_t **out, char *err, size_t errlen);
/* A regular expression (Python/ECMAScript syntax subset) matched against the whole output. */
kv_status gram_compile_regex(const char *re, size_t len, gram_t **out, char *err, size_t errlen);
/* Exactly one of n strings (1 <= n <= GRAM_MAX_CHOICES; their total length at most about
 * 1 MiB, the element limit). The strings form a trie, so thousands of choices cost what their
 * shared prefixes cost; the same limit applies to a JSON schema's enum and anyOf. */
#define GRAM_MAX_CHOICES 65536
kv_status gram_compile_choice(const char *const *s, const size_t *len, int n, gram_t **out,
                              char *err, size_t errlen);
/* A GBNF grammar (llama.cpp's format) with a rule named "root". */
kv_status gram_compile_ebnf(const char *src, size_t len, gram_t **out, char *err, size_t errlen);

gram_t *gram_ref(gram_t *g);
void gram_unref(gram_t *g);
/* Number of rules / elements (for logs and tests). */
int gram_n_rules(const gram_t *g);
int gram_n_elems(const gram_t *g);

/* ---------------------------------------------------------------- vocabulary
 * tok_bytes[i], tok_len[i]: the output bytes of token i (i < n_vocab; len 0 or a NULL entry =
 * never allowed); eog: the end-of-generation ids (allowed when the grammar is complete).
 * Copies everything. NULL on ENOMEM. */
gram_vocab_t *gram_vocab_new_bytes(const char *const *tok_bytes, const int *tok_len, int n_vocab,
                                   const int32_t *eog, int n_eog);
/* From a tokenizer: tok_token_bytes of every non-special token below min(n_vocab,
 * tok_n_vocab(t)); ids at or above tok_n_vocab (a model's padded rows) are never allowed. */
gram_vocab_t *gram_vocab_new(const tokenizer_t *t, int n_vocab, const int32_t *eog, int n_eog);
void gram_vocab_free(gram_vocab_t *v);
int gram_vocab_size(const gram_vocab_t *v);
/* Bytes of token id (borrowed; *len 0 for special tokens). */
const char *gram_vocab_token(const gram_vocab_t *v, int32_t id, int *len);

/* ---------------------------------------------------------------- matching */

/* A matcher at the start of g (holds a reference to g; v is borrowed and must outlive it).
 * NULL on ENOMEM. */
gram_matcher_t *gram_matcher_new(gram_t *g, const gram_vocab_t *v);
/* An independent copy at the same position (n > 1 sequences from one prompt). NULL on ENOMEM. */
gram_matcher_t *gram_matcher_clone(const gram_matcher_t *m);
void gram_matcher_free(gram_matcher_t *m);

/* The tokens allowed next: a bitset of ceil(n_vocab / 64) words, bit i of word i/64 set when
 * token i is allowed (end-of-generation ids exactly when the grammar is complete). Borrowed:
 * valid until the next call on m. *n_allowed (optional): the number of bits set. NULL on
 * failure, with gram_matcher_status(m): KV_ENOMEM, or KV_ETOOLONG when computing the mask
 * needed more than GRAM_MASK_BUDGET work units (a pathological grammar: the caller fails the
 * request; a mask never takes more than the budget, so it cannot stall other sequences).
 * Masks are cached per (grammar, parser state): a state seen before costs a lookup. */
#define GRAM_MASK_BUDGET 10000000ull /* work units per mask (one sequence, one decode step) */
const uint64_t *gram_matcher_mask(gram_matcher_t *m, int *n_allowed);
/* gram_matcher_mask within budget work units (at most the default budget): the caller's
 * share of a budget it splits (the engine: one budget per request per step, shared by its
 * n > 1 sequences). Same results; KV_ETOOLONG when the mask costs more (a cached one too). */
const uint64_t *gram_matcher_mask_within(gram_matcher_t *m, uint64_t budget, int *n_allowed);
/* A 64-bit key of m's parser state (equal states, equal keys): lets a caller charge a state
 * once when several sequences are in it. */
uint64_t gram_matcher_state_key(const gram_matcher_t *m);
/* The default per-mask budget (GRAM_MASK_BUDGET unless a test set another). */
uint64_t gram_mask_budget(void);
/* Why the last gram_matcher_mask returned NULL (KV_OK if it did not). */
kv_status gram_matcher_status(const gram_matcher_t *m);
/* Work units (counted, not timed: gram_internal.h) of the mask of m's current state: what its
 * trie walk took, also when the mask came from the cache (a hit is charged what the walk
 * cost, so whether a mask is over a budget depends only on the grammar, the vocabulary and
 * the state, never on which request computed it first). */
uint64_t gram_matcher_last_work(const gram_matcher_t *m);
/* The per-mask work budget in units (0 = the default GRAM_MASK_BUDGET, 1e7: tens of ms).
 * Process-wide; for tests. */
void gram_set_mask_budget(uint64_t units);
/* Advances by token id. false (state unchanged) if the token is not allowed; an
 * end-of-generation id is allowed only when complete and makes the matcher final. */
bool gram_matcher_accept(gram_matcher_t *m, int32_t id);
/* Advances by raw bytes (tests, validation). false (state unchanged) if they leave the
 * grammar. */
bool gram_matcher_accept_bytes(gram_matcher_t *m, const char *s, size_t n);
/* The output so far is a complete sentence of the grammar. */
bool gram_matcher_is_complete(const gram_matcher_t *m);
/* Complete and nothing may follow (or an end-of-generation token was accepted): generation
 * must end here. */
bool gram_matcher_is_final(const gram_matcher_t *m);

/* Process-wide counters (all grammars): mask computations served from the cache and
 * computed by a trie walk, and the walk time. */
struct gram_stats {
    uint64_t mask_hits, mask_misses, walk_ns, trie_nodes_visited;
    uint64_t work_units;   /* work of all trie walks */
    uint64_t over_budget;  /* masks refused for exceeding the work budget */
};
void gram_get_stats(struct gram_stats *out);

/* ---------------------------------------------------------------- tool calls (toolcall.c)
 * How a model writes tool calls, chosen from its chat template (or --tool-call-parser):
 *   hermes      <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>   (Hermes, Qwen)
 *   llama3_json {"name": "f", "parameters": {...}}  (optionally after <|python_tag|>; several
 *               separated by "; ")                                            (Llama 3.1-3.3)
 *   mistral     [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]          (Mistral)
 */
enum gram_tool_fmt { GRAM_TOOLS_NONE = 0, GRAM_TOOLS_HERMES, GRAM_TOOLS_LLAMA3_JSON, GRAM_TOOLS_MISTRAL };
/* The format a chat template writes tool calls in (hermes when nothing is recognized). */
enum gram_tool_fmt gram_tool_fmt_detect(const char *chat_template);
const char *gram_tool_fmt_name(enum gram_tool_fmt f);
/* "hermes" | "llama3_json" | "mistral" -> the format; GRAM_TOOLS_NONE for anything else. */
enum gram_tool_fmt gram_tool_fmt_from_name(const char *s);

/* A grammar that admits only tool calls in format fmt: calls of the functions in tools (the
 * request's validated "tools" array) or, when only_name is not NULL, of that one function;
 * each call's arguments follow its "parameters" schema (strict: members
 * not listed are never generated; no "parameters" = {}). parallel: one or more calls,
 * else exactly one. Errors as the compile functions (a bad parameters schema names the
 * tool). */
kv_status gram_compile_tool_calls(enum gram_tool_fmt fmt, const json_t *tools,
                                  const char *only_name, bool parallel, gram_t **out, char *err,
                                  size_t errlen);

struct gram_tool_call {
    char *name;            /* owned */
    char *arguments;       /* owned: a JSON object as compact text */
};
void gram_tool_calls_free(struct gram_tool_call *c, int n);

/* Streaming extraction of tool calls from a model's output text. Text that is not part of a
 * call passes through as content as soon as it cannot be the start of one; a call is
 * reported whole once its end is seen. Owned by one request. */
typedef struct gram_tool_stream gram_tool_stream_t;
gram_tool_stream_t *gram_tool_stream_new(enum gram_tool_fmt fmt);
void gram_tool_stream_free(gram_tool_stream_t *s);
/* Feeds text; appends the content that is now final to content and returns (in *calls, heap,
 * caller frees with gram_tool_calls_free) the calls completed by this text. */
kv_status gram_tool_stream_push(gram_tool_stream_t *s, const char *text, size_t len,
                                kv_buf *content, struct gram_tool_call **calls, int *n_calls);
/* End of output: what is held back is parsed (calls) or released as content. */
kv_status gram_tool_stream_finish(gram_tool_stream_t *s, kv_buf *content,
                                  struct gram_tool_call **calls, int *n_calls);
/* Calls reported so far. */
int gram_tool_stream_n_calls(const gram_tool_stream_t *s);

#endif
