/*
 * engine internals shared by engine.c (thread, queues, step loop, events), submit.c (request
 * checks, the submit and cancel queues), sched.c (admission, budgets, chunked prefill,
 * preemption) and the other parts of the engine. Everything below the "engine thread
 * only" line is touched by the engine thread alone, without locks.
 */
#ifndef KV_ENGINE_INTERNAL_H
#define KV_ENGINE_INTERNAL_H

#include <pthread.h>

#include "../kvcache/kvcache.h"
#include "engine.h"
#include "sampler.h"
#include "stop.h"

/* Most top logprobs a request may ask for (OpenAI's bound); the device sampler reports as many */
#define ENGINE_MAX_TOP_LOGPROBS 20
_Static_assert(ENGINE_MAX_TOP_LOGPROBS <= BACKEND_MAX_TOP, "device sampling reports up to BACKEND_MAX_TOP");

/* Request states (architecture.md). Every state but FINISHED/FAILED/CANCELLED lives in one
 * engine list: WAITING in waiting[], PREFILL/DECODE in running[], TRANSFER_* in xfer[].
 *
 *   WAITING --admit--> PREFILL --last chunk--> DECODE --eos/stop/length--> FINISHED
 *      |                  context leg: first token --offer--> TRANSFER_OUT --done--> freed
 *      +--generation leg: blocks allocated, recv--> TRANSFER_IN --KV checked--> DECODE
 *   TRANSFER_IN --error/deadline--> FAILED;  any --cancel--> CANCELLED (transfer states keep
 *   their blocks until the transfer's completion arrives)
 *
 * Deadlines: TRANSFER_* and a generation leg's WAITING expire after the transfer timeout
 * plus a grace (disagg.c); the other states have none (the request's own length bounds them). */
enum req_state {
    REQ_WAITING = 0, REQ_PREFILL, REQ_DECODE, REQ_TRANSFER_OUT, REQ_TRANSFER_IN,
    REQ_FINISHED, REQ_FAILED, REQ_CANCELLED,
};
const char *req_state_name(enum req_state s);

struct request {
    uint64_t id;
    enum req_state state;
    uint64_t deadline_ns;       /* 0 = none (see enum req_state) */
    engine_event_cb cb;
    void *user;                 /* borrowed until the terminal event */
    int32_t *tokens;            /* (cap) prompt ids, then generated ids; owned */
    int n_prompt, n_tokens, cap;
    int n_computed;             /* leading tokens whose K/V is in the cache */
    int32_t *blocks;            /* (n_blocks) block table, position order; owned */
    int n_blocks, blocks_cap;
    int max_gen;                /* generated-token limit: min(max_tokens, max_model_len - n_prompt) */
    struct sampling_params sp;
    bool ignore_eos;
    kv_rng rng;
    uint64_t seed_base;         /* choice i's RNG is seeded seed_base + i */
    /* choices (fork.c): a request with n_choices > 1 forks at its first token */
    int n_choices;              /* choices still to create, this one included (1 = none) */
    int index;                  /* choice index (events) */
    uint64_t group;             /* the id engine_submit returned (cancel; events' req_id) */
    /* logits processing (logits.c) and scheduling */
    struct logit_bias *bias;    /* (n_bias) owned */
    int n_bias;
    int32_t *stop_ids;          /* (n_stop_ids) owned: stop_token_ids */
    int n_stop_ids;
    int min_tokens;
    int priority;               /* lower = more urgent (sched.c) */
    struct stop_matcher stop;
    tok_stream_t *stream;       /* created lazily on the engine thread; NULL without tokenizer */
    gram_matcher_t *gm;         /* owned; NULL = unconstrained. Per sequence: a choice forked
                                   from another (n > 1) takes gram_matcher_clone() of it */
    uint64_t t_arrival_ns, t_admitted_ns, t_first_ns;
    /* per-step scheduling state */
    int chunk;                  /* tokens scheduled this step (0 = not scheduled) */
    /* KV reuse (reuse.c) */
    uint8_t *root_bytes;        /* tagged extra keys (cache_salt), owned; NULL if none */
    size_t root_len;
    bool root_done;
    kv_hash root_hash;
    uint64_t root_uid;          /* refreshed at each admission */
    kv_hash *bhash;             /* (blocks_cap) hash of each full block of tokens */
    uint64_t *buid;             /* (blocks_cap) index uid of blocks[i] for i < n_reg */
    int n_hashed, n_reg;
    int cached_tokens;          /* prompt tokens reused at first admission (-1 = not yet) */
    int wait_passes;            /* scheduler passes spent in prefix waits (never reset) */
    /* disaggregated serving (disagg.c) */
    enum engine_disagg_mode disagg;
    uint64_t disagg_id;
    bool context_first;
    char *peer;                 /* owned: generation leg's peer endpoint */
    int32_t first[4];
    int n_first;
    struct token_logprob first_lp;
    struct token_logprob first_top[20];
    int n_first_top;
    bool has_first_lp;
    bool terminal_sent;         /* the client saw its terminal event; only the blocks remain */
    bool unborn;                /* a choice of n > 1 ended before the fork made it a request of
                                   its own: its terminal event is not counted in the stats
                                   (requests_total counts choices as the fork makes them) */
    bool xfer_cancelled;        /* cancel was sent to the transfer; waiting for its completion */
    int n_recv_from;            /* generation leg: first block index received (cached before) */
};

static inline int req_n_gen(const struct request *r) { return r->n_tokens - r->n_prompt; }

/* One sequence of the step being built. */
struct sched_entry {
    struct request *r;
    int n_tokens;               /* new tokens this step, starting at r->n_computed */
    bool logits;                /* the chunk reaches the end: sample after the forward */
};

struct engine {
    struct engine_config cfg;
    const model_t *m;
    const tokenizer_t *t;       /* may be NULL (tests): no text, EOS from the model config */
    backend_t *be;
    int n_vocab;

    pthread_t thread;
    bool thread_started;

    /* ---- shared, under mu ---- */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_cond_t idle_cv;   /* broadcast when the engine thread goes to sleep with no work */
    bool idle;                /* under mu: asleep with no work, stats published */
    int fault_leak;           /* under mu: engine_fault_leak_blocks not yet taken */
    int32_t *leaked;          /* engine thread: blocks taken by engine_fault_leak_blocks */
    int n_leaked;
    bool stopping;
    struct request **incoming;  /* submitted, not yet seen by the engine thread */
    int n_incoming, cap_incoming;
    uint64_t *cancels;
    int n_cancels, cap_cancels;
    struct xfer_done *xdone;    /* transfer completions (engine_kv_transfer_done) */
    int n_xdone, cap_xdone;
    struct engine_kv_transfer xt;
    bool has_xt;
    int n_queued;               /* incoming + waiting (for KV_EBUSY) */
    uint64_t next_id;
    kv_rng seed_rng;            /* seeds for requests without one */

    /* ---- stats, under stats_mu ---- */
    pthread_mutex_t stats_mu;
    struct engine_stats stats;

    /* ---- engine thread only ---- */
    kv_pool_t *pool;
    struct request **waiting;   /* arrival order; preempted requests at the front */
    int n_waiting, cap_waiting;
    struct request **running;   /* admission order: running[n_running-1] is the newest */
    int n_running, cap_running;
    struct request **xfer;      /* TRANSFER_OUT / TRANSFER_IN (disagg.c) */
    int n_xfer, cap_xfer;
    uint64_t xstats[5];         /* sends ok/failed, recvs ok/failed, timeouts */
    struct sched_entry *plan;   /* (max_batch_size) this step */
    int n_plan;
    struct batch_seq *seqs;     /* (max_batch_size) */
    float *logits;              /* (max_batch_size, n_vocab) */
    struct sampler_scratch scratch;
    /* constrained decoding (constrain.c): the vocabulary trie, built at the first request
     * with a grammar (any thread, under gv_mu) */
    pthread_mutex_t gv_mu;
    gram_vocab_t *gvocab;
    uint64_t grammar_ns, grammar_steps; /* engine thread; published with the stats */
    /* the mask work charged in the current step per request (group: its n > 1 sequences
     * share one budget; a parser state is charged once per request and step), so that one
     * request cannot hold a step longer than GRAM_MASK_BUDGET units; engine thread, emptied
     * at the start of every step. An entry per request (is_state false: work = what it was
     * charged) and per (request, state key) charged (is_state true). */
    struct constrain_work { uint64_t group, key, work; bool is_state; } *gwork;
    int n_gwork, cap_gwork;
    struct token_logprob *top;  /* (20) */
    struct backend_sampling *bsamp;   /* (max_batch_size) device sampling requests of a step */
    struct backend_sample_out *bout;  /* (max_batch_size) and their results */
    bool dev_sampling;          /* be->ops->forward_sample && !cfg.host_sampling */
    float *fork_row;            /* (n_vocab) a choice's copy of the shared first logits */
    int32_t *eog_ids;           /* (n_eog) end-of-generation ids (min_tokens bans them) */
    int n_eog;
    kv_buf text, text2;         /* per-event scratch */
    uint64_t n_preempt_step;
    /* KV reuse (reuse.c) */
    bool reuse;
    int wait_blocks;            /* <= 0: prefix waits off */
    kv_hash_key key;
    uint8_t *host_mem;          /* (host_cache_blocks * block_bytes) */
    size_t block_bytes;
    int stall_passes;           /* consecutive passes without progress */
    uint64_t waits_step, query_tokens, hit_tokens, checksum_failures, deadlock_failures;
    uint64_t worker_id;
    /* KV event ring, under ev_mu */
    pthread_mutex_t ev_mu;
    struct engine_kv_event *ev_ring; /* (EV_RING) tokens point into ev_tok */
    int32_t *ev_tok;            /* (EV_RING * tokens_per_block) */
    uint64_t ev_seq;            /* last assigned */
    void (*ev_notify)(void *); /* engine_set_kv_notify: called once per batch of new events */
    void *ev_notify_arg;
    bool ev_notified;           /* notify called, no engine_kv_events since */
};

#define ENGINE_EV_RING ENGINE_KV_EVENTS_RING
#define ENGINE_WAIT_PASSES 128
#define ENGINE_STALL_PASSES 1000

/* ---- sched.c ---- */
/* Builds e->plan for one step (allocating blocks, preempting and admitting as needed).
 * Requests that can never run are failed (terminal event) from inside. Returns n_plan. */
int sched_step(struct engine *e);
/* Releases every block of r (block table emptied, n_computed = 0). */
void sched_free_blocks(struct engine *e, struct request *r);
/* Removes r from running/waiting if present. */
void sched_remove(struct engine *e, struct request *r);
/* Inserts r into waiting (capacity for one more must exist; no locking) by priority: at the
 * front of its priority class (preempted: it arrived before the others) or at its back (a new
 * arrival). With equal priorities that is FIFO with preempted requests first. */
void sched_insert_waiting(struct engine *e, struct request *r, bool front);

/* ---- reuse.c ---- */
/* Sets up the reuse index, host tier and event ring from cfg (engine_start). */
kv_status reuse_init(struct engine *e, char *err, size_t errlen);
void reuse_destroy(struct engine *e);
/* Serializes p's extra keys into r->root_bytes (engine_submit). KV_ENOMEM. */
kv_status reuse_request_init(struct request *r, const struct engine_request_params *p);
void reuse_request_free(struct request *r);
/* Admission of a request with no blocks: pins the longest cached prefix of full blocks
 * (never the block holding the last token) and sets n_blocks / n_computed. */
void reuse_match(struct engine *e, struct request *r);
/* Full blocks of r's prefix the index holds now (device or host tier; never the block with
 * the last token), without pinning anything. 0 when reuse is off. */
int reuse_probe(struct engine *e, struct request *r);
/* Registers r's full computed blocks in the index (after a forward). */
void reuse_register(struct engine *e, struct request *r);
/* True if waiting request r should wait this pass for an in-flight owner (counts the pass). */
bool reuse_should_wait(struct engine *e, struct request *r);
/* Runs the pool's queued host copies (before a forward). KV_OK or the backend's error. */
kv_status reuse_flush_copies(struct engine *e);
/* Adds reuse counters to a stats snapshot (under stats_mu). */
void reuse_fill_stats(struct engine *e, struct engine_stats *s);

/* ---- disagg.c ---- */
struct xfer_done {
    uint64_t disagg_id;
    bool is_send;
    kv_status status;
    char message[160];
    int32_t first[4];
    int n_first;
    uint64_t tokens_hash;
    bool has_lp;
    struct token_logprob lp, top[20];
    int n_top;
};
/* Context leg after its first token: moves r from running to TRANSFER_OUT, offers its blocks and
 * posts the terminal event with fin (FINISH_NOT_FINISHED, or stop/length for a generation-first
 * leg that ended at its first token: its generation leg still needs the token). Returns false if
 * the offer failed (r was failed and freed). */
bool disagg_begin_send(struct engine *e, struct request *r, enum finish_reason fin);
/* Admission of a waiting generation leg: true if r left waiting (now TRANSFER_IN, or failed);
 * false if it must keep waiting for blocks (nothing pinned). */
bool disagg_admit_recv(struct engine *e, struct request *r);
/* Applies queued completions (engine thread). */
void disagg_apply_done(struct engine *e, struct xfer_done *d, int n);
/* Cancel of a request in xfer[] (true if found there). */
bool disagg_cancel(struct engine *e, uint64_t req_id);
/* Deadlines of xfer[] and of waiting generation legs; returns the nearest future deadline
 * (0 = none) for the engine thread's timed wait. */
uint64_t disagg_check_deadlines(struct engine *e);
/* Shutdown: every transfer-state request is freed (terminal event if not yet sent). */
void disagg_shutdown(struct engine *e);
/* Probe requests: answers r (terminal FINISH with cached_tokens) and frees it. */
void disagg_answer_probe(struct engine *e, struct request *r);

/* ---- fork.c (n > 1 choices) ---- */
/* r (running, its prompt just computed, logits = its first-token row, unmodified) has
 * n_choices > 1: creates choices 1..n-1 sharing r's prompt blocks, samples each one's first
 * token from its own copy of logits and appends it to running (or fails it). r keeps choice
 * 0; its n_choices becomes 1. Returns the tokens sampled (for the stats). */
int fork_choices(struct engine *e, struct request *r, const float *logits);
/* Copies p's choice/logits/scheduling fields into r (engine_submit). KV_ENOMEM. */
kv_status fork_request_init(struct request *r, const struct engine_request_params *p);

/* ---- logits.c ---- */
/* Collects the end-of-generation ids (engine_start). KV_ENOMEM. */
kv_status logits_init(struct engine *e);
/* In place on r's logits row, before penalties: logit_bias, then the min_tokens bans. */
void logits_apply(const struct engine *e, const struct request *r, float *logits);
/* True if id is one of r's stop_token_ids. */
bool logits_is_stop_id(const struct request *r, int32_t id);
/* ---- constrain.c (constrained decoding hooks) ---- */
/* Submit: r->gm for grammar g (builds the engine's vocabulary trie once). KV_EUNSUPPORTED
 * without a tokenizer, KV_ENOMEM. */
kv_status constrain_request_init(struct engine *e, struct request *r, gram_t *g, char *err, size_t errlen);
/* Before sampling: disallowed tokens of logits (n_vocab) become -inf. Returns the number of
 * allowed tokens (0: nothing may follow, the caller fails the request), -1 on ENOMEM, -2 when
 * the mask needed more than GRAM_MASK_BUDGET work units (the caller fails the request). */
int constrain_mask_logits(struct engine *e, struct request *r, float *logits);
/* After sampling: id if the grammar allows it, else the allowed token with the largest logit
 * (only reachable through NaN logits). */
int32_t constrain_check(struct engine *e, struct request *r, const float *logits, int32_t id);
/* Advances r's matcher by id. false if id is outside the grammar; *final: the output is now
 * complete and nothing may extend it. */
bool constrain_accept(struct engine *e, struct request *r, int32_t id, bool *final);
/* A new step: every request's mask budget is whole again. */
void constrain_step_begin(struct engine *e);
void constrain_destroy(struct engine *e);

/* ---- engine.c ---- */
/* Appends the sampled token id to r, emits its DELTA and, if r is done, its FINISH (a context
 * leg goes to TRANSFER_OUT instead). Returns true if r left the running list. */
bool engine_on_token(struct engine *e, struct request *r, int32_t id,
                     const struct token_logprob *chosen, const struct token_logprob *top,
                     int n_top);
/* Samples r's next token from its logits row lg (in place: logit_bias and min_tokens bans,
 * the grammar mask, penalties; then the sampler) and hands it to engine_on_token. false when
 * r failed instead (its grammar allows no token: r is freed). */
bool engine_sample(struct engine *e, struct request *r, float *lg);
/* Terminal event without freeing (disagg.c). */
void engine_post_terminal(struct engine *e, struct request *r, enum engine_event_type type,
                          enum finish_reason fin, kv_status st, const char *msg);
void engine_request_free(struct request *r);
kv_status engine_vec_grow(void **arr, int *cap, int need, size_t elt);
void engine_publish_stats(struct engine *e, bool step);
/* Posts r's terminal ERROR event, frees its blocks and the request. r must already be out
 * of the running/waiting lists. */
void engine_fail_request(struct engine *e, struct request *r, kv_status st, const char *msg);
/* Adjusts the shared queued-request counter (under mu). */
void engine_queued_add(struct engine *e, int delta);
/* Is id an end-of-generation token of the model / tokenizer? */
bool engine_is_eog(const struct engine *e, int32_t id);
/* The first request of running/waiting whose group (or id) is id, or NULL. */
struct request *engine_find_live(struct engine *e, uint64_t id);

#endif
