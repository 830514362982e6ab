/*
 * engine: request state, the continuous-batching scheduler (token budget per step,
 * chunked prefill mixed with decodes, preemption by recompute), the sampler, stop
 * conditions and streaming detokenization. One engine thread owns all request and KV
 * state; other threads talk to it only through engine_submit / engine_cancel (queues)
 * and read engine_get_stats (a snapshot under a mutex).
 *
 * Request state machine:
 *
 *   submit -> WAITING --admit (blocks allocated)--> PREFILL --last prompt chunk--> DECODE
 *                ^                                    |                            |
 *                +------- preempted (blocks freed, recompute later) <--------------+
 *   any state --cancel--> CANCELLED;  DECODE --eos/stop/length--> FINISHED;  errors -> FAILED
 *
 * Scheduling per step (after vLLM v1 / TRT-LLM): running DECODE requests first (1 token
 * each), then PREFILL chunks of running requests, then admit WAITING requests in order
 * (priority, then arrival) while the step has token budget (max_num_tokens) and batch slots
 * (max_batch_size) and the pool has blocks. When a running request needs a block and none
 * is free, the least urgent (highest priority value), then newest, running request is
 * preempted (its blocks freed; it goes back to the front of its priority class in WAITING
 * and recomputes prompt + generated tokens later). Results never depend on batching: each
 * sequence's tokens are computed exactly as if it ran alone.
 *
 * Events: for every request the callback receives zero or more ENGINE_EV_DELTA events and
 * then exactly one terminal event (ENGINE_EV_FINISH or ENGINE_EV_ERROR), also after
 * engine_cancel and engine shutdown. The callback runs on the engine thread, must not
 * block and must not call back into the engine; event data is only valid during the call.
 * The `user` pointer must stay valid until the terminal event.
 */
#ifndef KV_ENGINE_H
#define KV_ENGINE_H

#include "../backend/backend.h"
#include "../base/base.h"
#include "../grammar/grammar.h"
#include "../hash/hash.h"
#include "../model/model.h"
#include "../tokenizer/tokenizer.h"

struct sampling_params {
    float temperature;        /* 0 = greedy (argmax; ties -> lowest id) */
    int top_k;                /* <= 0 disables */
    float top_p;              /* 1.0 disables */
    float min_p;              /* 0 disables */
    bool has_seed;
    uint64_t seed;            /* same seed + same prompt + same params -> same output */
    float presence_penalty;   /* OpenAI semantics, over generated tokens */
    float frequency_penalty;  /* OpenAI semantics, over generated tokens */
    float repetition_penalty; /* 1.0 disables; CTRL-style over prompt + generated tokens */
    int top_logprobs;         /* number of alternatives per token (0..20) */
    bool logprobs;            /* report the chosen token's logprob */
};
void sampling_params_default(struct sampling_params *sp);

/* One logit_bias entry: bias is added to the token's logit before penalties and sampling
 * (OpenAI; -100 effectively bans the token, +100 all but forces it). */
struct logit_bias {
    int32_t id;               /* in [0, n_vocab) */
    float bias;               /* in [-100, 100] */
};
#define ENGINE_MAX_CHOICES 128 /* n */

struct engine_request_params {
    const int32_t *prompt_ids; /* copied by engine_submit */
    size_t n_prompt;           /* >= 1 */
    struct sampling_params sp;
    int max_tokens;            /* >= 1; the engine also caps at max_model_len - n_prompt */
    const char *const *stop;   /* stop strings (copied); never appear in the output */
    int n_stop;
    bool ignore_eos;
    const char *cache_salt;    /* NULL = none; copied. Requests with different salts never
                                  share KV blocks (it is a type-tagged extra key of the hash) */
    /* ---- choices, logits processing, scheduling (docs/api.md; zero = defaults) ---- */
    int n;                     /* choices (0 or 1 = one; at most ENGINE_MAX_CHOICES). The prompt
                                  is prefilled once; at its first token the request forks into
                                  n choices that share the prompt's full KV blocks (refcounted;
                                  the partial last block is copied, or recomputed by the choice
                                  when the backend cannot copy blocks). Choice i samples with
                                  its own RNG seeded seed + i (vLLM's rule), so choice i equals
                                  the same request with n = 1 and seed + i, bitwise. Events
                                  carry the choice index; each choice has its own terminal
                                  event; engine_cancel of the returned id cancels them all. */
    const struct logit_bias *logit_bias; /* (n_logit_bias) copied; ids must be in range */
    int n_logit_bias;
    const int32_t *stop_token_ids; /* (n_stop_token_ids) copied: generating one ends the choice
                                  with FINISH_STOP; its text is kept (vLLM), also with
                                  ignore_eos */
    int n_stop_token_ids;
    int min_tokens;            /* until this many tokens are generated: EOS (unless ignore_eos)
                                  and stop_token_ids get logit -inf, and stop strings are not
                                  matched (text before then can never end the choice).
                                  0..max_tokens */
    /* n > 1, logit_bias and min_tokens work on the host's logits rows: an engine whose backend
     * samples on the device (forward_sample, without host_sampling) refuses them at submit
     * with KV_EUNSUPPORTED. */
    int priority;              /* lower = more urgent (vLLM): admitted before waiting requests
                                  of a higher value, preempted after running ones of a higher
                                  value; equal values keep arrival order */
    gram_t *grammar;           /* NULL = unconstrained; borrowed (the engine takes a reference).
                                  Every sampled token keeps the output inside the grammar (the
                                  sampler sees only the allowed tokens, whatever the sampling
                                  mode); end-of-generation tokens are allowed exactly when the
                                  output is complete, and a complete output that nothing may
                                  extend ends the request with FINISH_STOP (also with
                                  ignore_eos). Needs a tokenizer (KV_EUNSUPPORTED without). */
    /* ---- disaggregated serving (docs/disaggregation.md); zero = an ordinary request ---- */
    enum engine_disagg_mode {
        ENGINE_DISAGG_NONE = 0,
        /* context leg: prefill, sample the first token, then keep the prompt's blocks pinned
         * and offer them (engine_kv_transfer.offer) under disagg_id; the terminal event comes
         * right after the first token, with finish FINISH_NOT_FINISHED (or stop/length if the
         * request already ended: then nothing is offered) */
        ENGINE_DISAGG_CONTEXT_ONLY,
        /* generation leg: admit with blocks allocated for the prompt (its own cached prefix
         * reused), pull the blocks it lacks from peer_endpoint (engine_kv_transfer.recv), then
         * emit first_tokens (context first) or the token the transfer brings (generation
         * first) and decode on */
        ENGINE_DISAGG_GENERATION_ONLY,
        /* no generation: the terminal FINISH event reports cached_tokens = the prompt prefix
         * this worker's KV cache holds right now (device or host tier, whole blocks, never the
         * block of the last token) and prompt_tokens. Nothing is pinned or computed. */
        ENGINE_DISAGG_PROBE,
    } disagg;
    uint64_t disagg_id;        /* context/generation: the transfer key (disagg_request_id) */
    bool context_first;        /* schedule style (generation: how the sender treats us) */
    const char *peer_endpoint; /* generation: the context worker's transfer endpoint (copied) */
    const int32_t *first_tokens; /* generation, context first: tokens the context worker sampled */
    int n_first;               /* 0..4; 0 = they come with the KV (generation first) */
    const struct token_logprob *first_logprob; /* optional: the first token's logprob (and */
    const struct token_logprob *first_top;     /* its n_first_top alternatives), reported with */
    int n_first_top;                           /* the first token when logprobs are asked for */
};

enum engine_event_type { ENGINE_EV_DELTA = 0, ENGINE_EV_FINISH, ENGINE_EV_ERROR };

enum finish_reason {
    FINISH_NONE = 0, FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED,
    FINISH_NOT_FINISHED, /* context leg: the KV cache was offered to a generation worker */
};
/* "stop", "length", "cancelled", "not_finished" */
const char *finish_reason_str(enum finish_reason r);

struct token_logprob {
    int32_t id;
    float logprob;            /* natural log of the post-penalty, pre-temperature softmax (with a
                                 grammar: over the allowed tokens only; others are -inf) */
};

struct engine_event {
    enum engine_event_type type;
    uint64_t req_id;          /* the id engine_submit returned (the same for every choice) */
    int index;                /* choice index in [0, n) */
    /* DELTA (and possibly FINISH, with the final held-back text): */
    const char *text;         /* newly final UTF-8 text (stop strings removed); may be "" */
    size_t text_len;
    const int32_t *ids;       /* tokens generated since the last event */
    int n_ids;
    const struct token_logprob *logprobs; /* (n_ids) chosen tokens, NULL unless requested */
    const struct token_logprob *top;      /* (n_ids * n_top) alternatives, NULL unless requested */
    int n_top;
    /* FINISH: */
    enum finish_reason finish;
    int prompt_tokens;
    int completion_tokens;
    int cached_tokens;
    /* ERROR: */
    kv_status status;
    const char *message;
    /* timings (monotonic ns): arrival, first admission (0 = never admitted), first token */
    uint64_t t_arrival_ns, t_admitted_ns, t_first_token_ns;
};

typedef void (*engine_event_cb)(const struct engine_event *ev, void *user);

struct engine_config {
    int tokens_per_block;     /* default 16 */
    int n_blocks;             /* KV pool size in blocks (>= blocks for one max_model_len seq) */
    int max_batch_size;       /* sequences per step, default 64 */
    int max_num_tokens;       /* token budget per step, default 512 */
    int max_model_len;        /* prompt + generated tokens per request */
    int max_queue;            /* waiting requests before submit returns KV_EBUSY, default 1024 */
    /* ---- KV reuse (zero = defaults) ---- */
    bool no_prefix_cache;     /* true: no reuse index, no host tier, no prefix waits */
    int host_cache_blocks;    /* host offload tier size in blocks (0 = none) */
    int prefix_wait_blocks;   /* in-flight prefix waits: a new request waits for a prefilling
                                 owner that will cover >= this many more blocks than the
                                 cache offers. 0 = default (engine_default_wait_blocks);
                                 < 0 disables */
    const kv_hash_key *hash_key; /* per-worker secret (copied); NULL = random at start */
    int kv_dtype;             /* enum kv_dtype of the KV pool (backend/backend.h); 0 = f32.
                                 The backend's kv_alloc refuses a dtype it does not support
                                 (CPU: f32 only) and engine_start fails with its status. */
    bool host_sampling;       /* sample on the host even when the backend samples on the device
                                 (backend_ops.forward_sample: CUDA); default false: the device
                                 samples and only ids and logprobs come back (sampler.h says
                                 where the two can differ; serve --host-sampling) */
    /* ---- test hook (0 = off; serve: env KVSERVE_TEST_HOLD_PREFILL, docs/testing.md) ---- */
    uint64_t test_hold_prefill_tokens; /* once prefill_tokens_computed reaches this, no further
                                 step runs (submits, cancels, transfer completions and deadlines
                                 are still handled): a test keeps a request mid-prefill, its
                                 blocks held, for as long as it needs, without timing */
};

struct engine_stats {
    /* every request ends in exactly one of finished / failed / cancelled (an error event with
     * KV_ECANCELLED -- shutdown, a peer-cancelled KV transfer -- counts as cancelled) */
    uint64_t requests_total, requests_finished, requests_failed, requests_cancelled;
    uint64_t prompt_tokens_total, generation_tokens_total, prefill_tokens_computed;
    uint64_t preemptions_total, steps_total;
    int n_waiting, n_running;
    int kv_blocks_total, kv_blocks_free, kv_blocks_used;
    /* KV reuse */
    bool prefix_cache_enabled;
    uint64_t prefix_cache_query_tokens; /* prompt tokens at first admission of each request */
    uint64_t prefix_cache_hit_tokens;   /* of those, taken from the cache */
    int kv_blocks_cached;               /* refcount-0 blocks kept for reuse (counted as free) */
    int kv_host_blocks_total, kv_host_blocks_cached;
    uint64_t kv_evictions, kv_offloads, kv_host_evictions; /* blocks */
    uint64_t kv_hits_device, kv_hits_host;                 /* blocks acquired from each tier */
    uint64_t prefix_waits_total;        /* scheduler passes a request spent waiting */
    uint64_t kv_checksum_failures;      /* debug builds: host round trips that changed bytes */
    uint64_t deadlock_failures;         /* requests failed by the no-progress detector */
    /* disaggregated serving */
    int n_transfer_out, n_transfer_in;  /* requests whose blocks a transfer holds now */
    uint64_t kv_sends_ok, kv_sends_failed, kv_recvs_ok, kv_recvs_failed;
    uint64_t kv_transfer_timeouts;      /* engine-side deadlines that fired */
    /* constrained decoding: engine-thread time in the grammar hooks (mask, check, accept)
     * and the number of masked sampling steps */
    uint64_t grammar_ns, grammar_steps;
};

typedef struct engine engine_t;

/* Creates the engine (allocates the KV pool through the backend) and starts its thread.
 * Borrowed: model, tokenizer, backend (must outlive the engine). KV_EINVAL if the config
 * is inconsistent (e.g. the pool cannot hold one max_model_len sequence); KV_ENOMEM. */
kv_status engine_start(const struct engine_config *cfg, const model_t *m, const tokenizer_t *t,
                       backend_t *be, engine_t **out, char *err, size_t errlen);
/* Stops the thread: every live request gets ENGINE_EV_ERROR (KV_ECANCELLED) first. */
void engine_stop(engine_t *e);

/* Queues a request (thread-safe). On KV_OK *req_id is set and cb will receive the events
 * (possibly before engine_submit returns). Errors (nothing queued, cb never called):
 * KV_EINVAL (empty prompt, bad params), KV_ETOOLONG (prompt does not fit max_model_len),
 * KV_EBUSY (queue full), KV_EIO (the backend is unhealthy: engine_healthy). err gets a
 * client-facing message. */
kv_status engine_submit(engine_t *e, const struct engine_request_params *p, engine_event_cb cb,
                        void *user, uint64_t *req_id, char *err, size_t errlen);
/* Cancels (thread-safe, idempotent, unknown ids ignored). The request's blocks are free by
 * the next step; its terminal event is ENGINE_EV_FINISH with FINISH_CANCELLED. */
void engine_cancel(engine_t *e, uint64_t req_id);
void engine_get_stats(engine_t *e, struct engine_stats *out);
/* False once the backend reports it can no longer compute (backend_ops.healthy: a sticky CUDA
 * error); why gets the reason. Thread-safe. After that engine_submit refuses requests with
 * KV_EIO and the running ones fail with the backend's error. */
bool engine_healthy(engine_t *e, char *why, size_t whylen);
/* Blocks until the engine thread has nothing to do (no queued, waiting, running or
 * transferring request, no pending cancel) and has published the stats of its last step, or
 * timeout_ms passes (KV_EBUSY). A barrier for tests and drains instead of polling stats:
 * after KV_OK, engine_get_stats shows every finished request's tokens and freed blocks (a
 * request submitted meanwhile by another thread can make it busy again). Thread-safe. */
kv_status engine_wait_idle(engine_t *e, int timeout_ms);
/* Fault injection (tests): the engine thread takes n blocks from the KV pool at its next
 * pass and never returns them (until engine_stop), as a block leak would. Requests that then
 * cannot get blocks with nothing running stall; the deadlock detector fails them after
 * ENGINE_STALL_PASSES passes. Thread-safe. */
void engine_fault_leak_blocks(engine_t *e, int n);
const struct engine_config *engine_config(const engine_t *e);

/* ---- disaggregated serving: the KV-transfer seam ----
 * The engine never talks to a peer itself: it calls these (from the engine thread; they must
 * not block) and gets every outcome back through engine_kv_transfer_done. serve wires them to
 * the transfer agent (transfer/transfer.h); tests can plug in a mock. Each successful offer or
 * recv call must be followed by exactly one engine_kv_transfer_done for (disagg_id, is_send),
 * also after cancel; until then the engine keeps the blocks pinned (a peer may still read or
 * write them: BUG-08). */
struct engine_kv_transfer {
    void *ctx;
    /* Sender: blocks[0..n_blocks) hold the K/V of tokens [0, n_tokens). */
    kv_status (*offer)(void *ctx, uint64_t disagg_id, const int32_t *blocks, int n_blocks,
                       int n_tokens, const int32_t *first, int n_first, int cached_tokens,
                       uint64_t tokens_hash, const struct token_logprob *first_lp,
                       const struct token_logprob *first_top, int n_first_top);
    /* Receiver: fill dst[0..n_dst), the LAST n_dst blocks of the prompt's ceil(n_tokens/T). */
    kv_status (*recv)(void *ctx, uint64_t disagg_id, const char *peer, bool context_first,
                      const int32_t *dst, int n_dst, int n_tokens);
    void (*cancel)(void *ctx, uint64_t disagg_id);
    /* Optional: a generation leg that will never ask for its KV (cancelled or expired while
     * waiting for blocks) tells the sender at peer, so its blocks go now, not at its deadline.
     * No completion follows. */
    void (*cancel_remote)(void *ctx, uint64_t disagg_id, const char *peer);
    double timeout_s;          /* the transfer deadline; the engine adds a 5 s grace, then
                                  cancels, then after another grace frees the blocks anyway */
};
/* Installs the seam (copied). Call before submitting disaggregated requests; without it they
 * fail at submit with KV_EUNSUPPORTED. Not thread-safe against submits in flight. */
void engine_set_kv_transfer(engine_t *e, const struct engine_kv_transfer *xt);
/* Sender: the router says the generation leg of disagg_id will never pull its KV (it failed
 * for good, was never delivered, or its client left): drops the offer and unpins its blocks now
 * instead of at the transfer deadline (through xt.cancel, so the completion comes back as
 * KV_ECANCELLED through engine_kv_transfer_done like any cancel). An id not offered yet is
 * remembered by the agent and cancelled when it comes (generation first). Thread-safe (the
 * seam is only read); false when no seam is installed. */
bool engine_kv_release(engine_t *e, uint64_t disagg_id);
/* Reports one transfer outcome (thread-safe; the engine thread acts on it at its next pass).
 * first/n_first: generation-first receive: the tokens the context worker sampled. */
void engine_kv_transfer_done(engine_t *e, uint64_t disagg_id, bool is_send, kv_status status,
                             const char *message, const int32_t *first, int n_first);
/* Same, with the sender's engine_tokens_hash of the prompt (receive, KV_OK): a generation leg
 * whose own prompt hashes differently fails instead of decoding (or caching) someone else's KV.
 * tokens_hash 0 = not known (no check). first_lp / first_top (may be NULL / 0): the first
 * token's logprob and alternatives as the context worker computed them (generation first). */
void engine_kv_transfer_done_ex(engine_t *e, uint64_t disagg_id, bool is_send, kv_status status,
                                const char *message, const int32_t *first, int n_first,
                                uint64_t tokens_hash, const struct token_logprob *first_lp,
                                const struct token_logprob *first_top, int n_first_top);
/* FNV-1a 64 of the token ids (little-endian int32), never 0: what offer passes and the
 * receive checks. */
uint64_t engine_tokens_hash(const int32_t *ids, int n);

/* ---- KV events (for routers that mirror what this worker holds) ---- */
enum engine_kv_event_type { ENGINE_KV_STORED = 0, ENGINE_KV_REMOVED, ENGINE_KV_CLEARED, ENGINE_KV_TIER };
struct engine_kv_event {
    uint64_t seq;               /* 1, 2, 3, ... per engine */
    enum engine_kv_event_type type;
    kv_hash hash;               /* STORED / REMOVED / TIER */
    kv_hash parent_hash;        /* STORED: parent block hash, or the chain root */
    bool parent_is_root;
    int n_tokens;               /* STORED: tokens_per_block, ids in tokens */
    const int32_t *tokens;      /* points into the caller's tok buffer */
    bool host;                  /* TIER: the block moved to the host tier (false: to the device) */
};
#define ENGINE_KV_EVENTS_RING 4096
/* Copies up to cap buffered events with seq > after (oldest first) into out, their token ids
 * into tok (cap * tokens_per_block ids). Returns the count; *lost = events with seq > after
 * that were dropped from the ring (4096 events) before they could be read. Thread-safe. */
int engine_kv_events(engine_t *e, uint64_t after, struct engine_kv_event *out, int32_t *tok,
                     int cap, uint64_t *lost);
/* Push instead of polling: fn(arg) is called (from the engine thread, under the event ring's
 * lock: it must only signal, e.g. event_active) when an event is added and none was
 * notified since the last engine_kv_events call. NULL fn turns it off; after this returns,
 * the previous fn is not called any more. Thread-safe. */
void engine_set_kv_notify(engine_t *e, void (*fn)(void *arg), void *arg);
/* The last event sequence number assigned (0: none yet). Thread-safe. */
uint64_t engine_kv_last_seq(engine_t *e);
/* The default prefix_wait_blocks: an eighth of max_model_len in blocks, at least 1, at most
 * 64 (a fixed 64 could never trigger when max_model_len <= 1024 tokens at 16 per block). */
int engine_default_wait_blocks(const struct engine_config *c);
/* Worker id (random 64-bit, never 0, fixed for the engine's life, with or without the reuse
 * index) for KV events and /server_info. */
uint64_t engine_worker_id(const engine_t *e);
/* Public fingerprint of the block-hash secret (kv_hash_key_id, 16 hex digits): a router
 * mirroring this worker compares it with its own (--hash-key-file) and refuses a mismatch. */
void engine_hash_key_id(const engine_t *e, char out[17]);

#endif
