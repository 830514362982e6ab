/*
 * engine internals shared by engine.c (thread, queues, step loop, events) and sched.c
 * (admission, budgets, chunked prefill, preemption). Everything below the "engine thread
 * only" line is touched by the engine thread alone, without locks.
 */
#ifndef KV_ENGINE_INTERNAL_H
#define KV_ENGINE_INTERNAL_H

#include <pthread.h>

#include "../kvcache/kvcache.h"
#include "engine.h"
#include "sampler.h"
#include "stop.h"

struct request {
    uint64_t id;
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
    struct stop_matcher stop;
    tok_stream_t *stream;       /* created lazily on the engine thread; NULL without tokenizer */
    uint64_t t_arrival_ns, t_first_ns;
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
    bool stopping;
    struct request **incoming;  /* submitted, not yet seen by the engine thread */
    int n_incoming, cap_incoming;
    uint64_t *cancels;
    int n_cancels, cap_cancels;
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
    struct sched_entry *plan;   /* (max_batch_size) this step */
    int n_plan;
    struct batch_seq *seqs;     /* (max_batch_size) */
    float *logits;              /* (max_batch_size, n_vocab) */
    struct sampler_scratch scratch;
    struct token_logprob *top;  /* (20) */
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
/* Registers r's full computed blocks in the index (after a forward). */
void reuse_register(struct engine *e, struct request *r);
/* True if waiting request r should wait this pass for an in-flight owner (counts the pass). */
bool reuse_should_wait(struct engine *e, struct request *r);
/* Runs the pool's queued host copies (before a forward). KV_OK or the backend's error. */
kv_status reuse_flush_copies(struct engine *e);
/* Adds reuse counters to a stats snapshot (under stats_mu). */
void reuse_fill_stats(struct engine *e, struct engine_stats *s);

/* ---- engine.c ---- */
/* Posts r's terminal ERROR event, frees its blocks and the request. r must already be out
 * of the running/waiting lists. */
void engine_fail_request(struct engine *e, struct request *r, kv_status st, const char *msg);
/* Adjusts the shared queued-request counter (under mu). */
void engine_queued_add(struct engine *e, int delta);

#endif
