/*
 * http internals shared by the server files, openai.c, responses.c and metrics.c (not a
 * public API; the server's own loop state is in server_internal.h).
 *
 *   body bytes --oai_parse_*--> struct oai_request --(server: tokenize)--> token ids
 *              --oai_engine_params--> struct engine_request_params --> engine_submit
 *   engine events --(server: queue)--> resp_* builders --> JSON body / SSE chunks
 *
 * openai.c depends only on jansson and the struct definitions of engine.h/tokenizer.h (no
 * engine or tokenizer symbols), so the parser unit test links without a working engine.
 */
#ifndef KV_HTTP_INTERNAL_H
#define KV_HTTP_INTERNAL_H

#include <jansson.h>

#include "../engine/engine.h"
#include "../tokenizer/tokenizer.h"

/* A client-facing error: HTTP status + OpenAI error object fields. */
struct oai_error {
    int status;           /* 400, 404, 405, 413, 500, 503 */
    const char *type;     /* static: "invalid_request_error", "not_found_error", ... */
    const char *code;     /* static or NULL: "model_not_found", "context_length_exceeded" */
    char param[64];       /* offending parameter; "" -> JSON null */
    char message[512];
};
/* Fills e and returns KV_EINVAL (any status). */
kv_status oai_errf(struct oai_error *e, int status, const char *type, const char *param,
                   const char *code, const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* What the parser needs to know about the server. */
struct oai_limits {
    const char *served_name; /* requests naming another model get 404 model_not_found */
    int n_vocab;             /* token ids must be in [0, n_vocab) */
    int max_model_len;       /* max_tokens above this is rejected; <= 0 = no check */
    const char *const *aliases; /* (n_aliases) more names the model answers to (borrowed) */
    int n_aliases;
    int tool_fmt;            /* enum gram_tool_fmt: how the model writes tool calls (0 = hermes) */
};

enum oai_kind { OAI_COMPLETION = 0, OAI_CHAT, OAI_TOKENIZE, OAI_DETOKENIZE };

#define OAI_MAX_STOP 16
#define OAI_MAX_TOP_LOGPROBS_CHAT 20
#define OAI_MAX_LOGPROBS_COMPLETION 5
#define OAI_MAX_CACHE_SALT 256 /* bytes */
#define OAI_MAX_STOP_TOKEN_IDS 256

/* disaggregated_params of a context or generation leg (docs/disaggregation.md). */
enum oai_disagg_type { OAI_DISAGG_NONE = 0, OAI_DISAGG_CONTEXT_ONLY, OAI_DISAGG_GENERATION_ONLY };
struct oai_disagg {
    enum oai_disagg_type type;
    uint64_t disagg_id;         /* disagg_request_id (required, < 2^53) */
    bool has_ctx_id;
    uint64_t ctx_request_id;
    bool context_first;         /* schedule_style (default context_first) */
    int32_t first[4];           /* first_gen_tokens (generation leg, context first) */
    int n_first;
    char *endpoint;             /* owned: ctx_info_endpoint */
    int32_t *prompt_ids;        /* owned: prompt_token_ids (generation leg) */
    size_t n_prompt_ids;
    bool has_first_lp;          /* first_gen_logprobs */
    struct token_logprob first_lp;
    struct token_logprob first_top[20];
    int n_first_top;
    char *conversation_id;      /* owned or NULL */
};

/* Structured output and tools of a request (structured.c). */
enum oai_so_kind { OAI_SO_NONE = 0, OAI_SO_JSON_OBJECT, OAI_SO_JSON_SCHEMA, OAI_SO_REGEX, OAI_SO_CHOICE, OAI_SO_GRAMMAR };
enum oai_tool_choice { OAI_TOOLS_AUTO = 0, OAI_TOOLS_NONE, OAI_TOOLS_REQUIRED, OAI_TOOLS_NAMED };
struct oai_structured {
    enum oai_so_kind kind;
    json_t *spec;               /* owned: the schema, regex or grammar string, or choice array */
    bool strict;                /* json_schema.strict */
    const char *param;          /* static: the field the constraint came from (error param) */
    const char *where;          /* static: the exact value compiled, e.g.
                                   "response_format.json_schema.schema" (compile errors) */
    json_t *tools;              /* owned or NULL: the request's non-empty "tools" (chat) */
    enum oai_tool_choice tool_choice;
    char *tool_name;            /* owned: a named tool_choice */
    bool parallel_tool_calls;   /* default true */
    /* set by oai_structured_compile: */
    gram_t *grammar;            /* owned reference; NULL = unconstrained */
    bool parse_tool_calls;      /* chat with tools (tool_choice not "none", no response_format):
                                   tool calls are extracted from the output */
};

/* A validated request. Everything is owned; release with oai_request_free. */
struct oai_request {
    enum oai_kind kind;
    bool stream;
    bool include_usage;         /* stream_options.include_usage */
    /* prompt, one of: */
    bool has_text;              /* completion/tokenize: text prompt (may be "") */
    char *text;                 /* owned, NUL-terminated (jansson rejects embedded NUL) */
    size_t text_len;
    int32_t *ids;               /* owned (n_ids): a pre-tokenized prompt / detokenize input */
    size_t n_ids;
    json_t *chat_msgs;          /* owned: chat (or tokenize with messages) -- the messages as
                                   the chat template sees them: role, content (a string, text
                                   parts joined, or null), name, tool_calls (arguments given as
                                   a JSON-object string become that object, as vLLM does),
                                   tool_call_id, reasoning_content */
    json_t *chat_kwargs;        /* owned or NULL: extra template variables: the request's
                                   chat_template_kwargs plus "tools" */
    bool add_generation_prompt; /* chat: open an assistant turn (default true) */
    bool continue_final_message; /* chat: the prompt ends inside the final (assistant) message,
                                   which the model continues (vLLM; no generation prompt) */
    char *cache_salt;           /* owned or NULL: "cache_salt" (<= OAI_MAX_CACHE_SALT bytes) */
    /* generation */
    struct sampling_params sp;
    int max_tokens;             /* -1 = until the context ends */
    bool max_tokens_given;      /* max_tokens / max_completion_tokens was in the request: a prompt
                                   that leaves less room is refused (400, as vLLM), not trimmed */
    char **stop;                /* owned (n_stop) */
    int n_stop;
    bool ignore_eos;
    int n;                      /* choices, 1..ENGINE_MAX_CHOICES */
    struct logit_bias *logit_bias; /* owned (n_logit_bias): ids in [0, n_vocab), [-100, 100] */
    int n_logit_bias;
    int32_t *stop_token_ids;    /* owned (n_stop_token_ids) */
    int n_stop_token_ids;
    int min_tokens;             /* 0..max_tokens */
    int priority;               /* lower = more urgent */
    bool tokens_as_ids;         /* return_tokens_as_token_ids: logprob tokens as "token_id:N" */
    bool add_special;           /* tokenize: add_special_tokens (default true) */
    struct oai_disagg disagg;   /* completions/chat: disaggregated_params */
    bool probe;                 /* POST /kv_probe: report the cached prefix, generate nothing */
    struct oai_structured so;   /* completions/chat: response_format, guided_*, tool choice */
};

/* Parses body[0..len) as the given endpoint's request. On error returns KV_EINVAL, fills *err
 * and leaves *out zeroed (nothing to free). On success the caller owns *out. */
kv_status oai_parse(enum oai_kind kind, const char *body, size_t len,
                    const struct oai_limits *lim, struct oai_request *out, struct oai_error *err);
void oai_request_free(struct oai_request *r);

/* True if name is the served name or one of its aliases (lim NULL or no name: any). */
bool oai_model_matches(const struct oai_limits *lim, const char *name);

/* ---- openai_sampling.c: n, best_of, logit_bias, stop_token_ids, min_tokens, priority ----
 * Parses those fields of o into r (r->max_tokens already parsed: -1 = until the context
 * ends). KV_EINVAL with err filled (param = the field). */
kv_status oai_parse_sampling(json_t *o, const struct oai_limits *lim, struct oai_request *r,
                             struct oai_error *err);
/* openai.c's field readers, shared with openai_sampling.c: oai_field = present and not null;
 * oai_get_int = an integer (or an integral real) within [lo, hi]. */
json_t *oai_field(json_t *o, const char *k);
kv_status oai_get_int(json_t *o, const char *k, int64_t lo, int64_t hi, bool *present,
                      int64_t *out, struct oai_error *err);

/* Engine parameters for r with the tokenized prompt (borrowed: ids, r's stop strings,
 * stop_token_ids, logit_bias and cache_salt).
 * max_tokens -1 becomes max_model_len - n_ids (at least 1). */
void oai_engine_params(const struct oai_request *r, const int32_t *ids, size_t n_ids,
                       int max_model_len, struct engine_request_params *p);

/* ---- structured.c ---- */
/* response_format, guided_json/regex/choice/grammar, structured_outputs of body o into r->so
 * (shape checks; at most one constraint). */
kv_status oai_parse_structured(json_t *o, struct oai_request *r, struct oai_error *err);
/* tool_choice and parallel_tool_calls (tools: the validated "tools" array or NULL). */
kv_status oai_parse_tool_choice(json_t *o, json_t *tools, struct oai_request *r, struct oai_error *err);
/* Compiles r->so into r->so.grammar (fmt: the model's tool-call format, for forced calls) and
 * decides whether tool calls are extracted. 400 naming the field and what is unsupported. */
kv_status oai_structured_compile(struct oai_request *r, enum gram_tool_fmt fmt, struct oai_error *err);
void oai_structured_free(struct oai_structured *so);

/* ---- prompt.c ---- */
struct prefix_cache;
/* The prompt of r as token ids, the worker's path (chat: template render with the null-content
 * fallback; BOS once; pc = prefix token cache or NULL; pre-tokenized prompts copied). *ids
 * heap. KV_EINVAL: the messages cannot be rendered (message in err); KV_ENOMEM. */
kv_status oai_prompt_ids(const tokenizer_t *t, struct prefix_cache *pc, const struct oai_request *r,
                         bool add_special, int32_t **ids, size_t *n, char *err, size_t errlen);
/* The same, refusing (KV_ETOOLONG, nothing tokenized) a rendered chat prompt longer than
 * max_bytes (0 = no bound): the early length check of prep.c. */
kv_status oai_prompt_ids_bounded(const tokenizer_t *t, struct prefix_cache *pc,
                                 const struct oai_request *r, bool add_special, size_t max_bytes,
                                 int32_t **ids, size_t *n, char *err, size_t errlen);

/* ---- responses.c ---- */

/* {"error":{"message","type","param","code"}} as a heap string (caller frees). */
char *resp_error_json(const struct oai_error *e);

/* Logprob entries for n tokens appended to acc: for completions acc is the object
 * {"tokens":[],"token_logprobs":[],"top_logprobs":[],"text_offset":[]} (text_offset counts
 * from *offset, which advances); for chat acc is {"content":[...]}. */
json_t *resp_logprobs_new(enum oai_kind kind);
void resp_logprobs_append(json_t *acc, enum oai_kind kind, const tokenizer_t *t, bool as_ids,
                          const struct token_logprob *lp, const struct token_logprob *top,
                          int n, int n_top, size_t *offset);

struct resp_meta {
    const char *id;       /* "cmpl-..." / "chatcmpl-..." */
    int64_t created;
    const char *model;
    enum oai_kind kind;
    int index;            /* resp_chunk_sse: the choice index of the chunk */
};
struct resp_usage {
    int prompt_tokens, completion_tokens, cached_tokens;
};
/* Non-stream body. logprobs: stolen reference or NULL (-> null). */
char *resp_full_json(const struct resp_meta *m, const char *text, size_t text_len,
                     json_t *logprobs, const char *finish, const struct resp_usage *u);
/* The same with n choices (index i = ch[i]; every logprobs stolen). */
struct resp_choice {
    const char *text;
    size_t text_len;
    json_t *logprobs;
    const char *finish;
};
char *resp_full_json_n(const struct resp_meta *m, const struct resp_choice *ch, int n,
                       const struct resp_usage *u);
/* One SSE event "data: {...}\n\n" for choice m->index appended to out. role: chat only, NULL
 * to omit; text may be NULL (chat: a delta without content; with no role either the delta is
 * {}, as OpenAI's last chunk); finish NULL -> null; logprobs stolen or NULL. */
kv_status resp_chunk_sse(kv_buf *out, const struct resp_meta *m, const char *role,
                         const char *text, size_t text_len, json_t *logprobs, const char *finish);
kv_status resp_usage_sse(kv_buf *out, const struct resp_meta *m, const struct resp_usage *u);
kv_status resp_error_sse(kv_buf *out, const struct oai_error *e);

/* ---- toolcalls.c (tool calls in chat responses) ---- */
/* Stream: text of one engine event through the extraction ts; writes a content chunk (with
 * lp, stolen) when there is content or lp, one tool_calls chunk per batch of completed calls
 * and, when fin is not NULL (terminal event), the final chunk whose finish_reason is
 * "tool_calls" if calls were made and fin is "stop". max_calls > 0: later calls are dropped
 * (parallel_tool_calls false). */
kv_status tools_stream_event(gram_tool_stream_t *ts, kv_buf *out, const struct resp_meta *m, const char *text,
                             size_t len, json_t *lp, const char *fin, int fmt, int max_calls, kv_rng *rng);
/* The text of token id when it is a tool-call marker of format fmt that the vocabulary makes
 * a special token, so that it is absent from the output text (Mistral's [TOOL_CALLS] in v3
 * tokenizers, <tool_call> in some Hermes vocabularies): gen.c puts it back for the
 * extraction. NULL otherwise. */
const char *tools_marker_text(const tokenizer_t *t, int fmt, int32_t id);
/* Non-stream: the chat body with choices[index].message.content / tool_calls set from that
 * choice's full output text (content null when only calls were made). Heap string or NULL
 * (ENOMEM). */
char *tools_rewrite_body(gram_tool_stream_t *ts, const char *body, int index, const char *text, size_t len,
                         int fmt, int max_calls, kv_rng *rng);

/* ---- metrics.c ---- */
/* A Prometheus histogram over fixed bucket bounds (seconds; metrics.c has the bounds of each
 * kind, vLLM's). Loop thread only. */
#define METRICS_MAX_BUCKETS 24
struct metrics_hist {
    uint64_t bucket[METRICS_MAX_BUCKETS]; /* observations <= bound[i] (not cumulative) */
    uint64_t count;
    double sum;
};
enum metrics_hist_kind { MH_TTFT = 0, MH_TPOT, MH_E2E, MH_QUEUE, MH_COUNT };
/* Latencies of finished requests (the worker's HTTP loop observes them). */
struct http_latency {
    struct metrics_hist h[MH_COUNT];
    uint64_t finished_stop, finished_length; /* choices by finish reason */
};
void metrics_observe(struct http_latency *l, enum metrics_hist_kind k, double seconds);

struct http_counters {
    uint64_t http_requests_total;
    uint64_t http_errors_4xx, http_errors_5xx;
    uint64_t client_disconnects;
    struct http_latency lat;        /* worker only (the router leaves it zero) */
};
/* What metrics_render reports about the KV cache besides engine_stats. */
struct metrics_info {
    int tokens_per_block;
    bool draining;                  /* /ready answers 503 */
};
/* kvserve_* metrics, then the same quantities under the names gateways and dashboards read
 * (vllm:*, docs/metrics.md): queue/running gauges, KV usage, token counters, prefix cache,
 * and the latency histograms of c->lat. info may be NULL. */
kv_status metrics_render(kv_buf *out, const struct engine_stats *s, const struct http_counters *c,
                         const struct metrics_info *info, const char *model_name);
/* Appends the prefix token cache counters (kvserve_prefix_token_cache_*). */
struct prefix_cache_stats;
kv_status metrics_render_prefix_token_cache(kv_buf *out, const struct prefix_cache_stats *s,
                                            const char *model_name);

#endif
