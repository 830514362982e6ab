/* sampler: penalties, logprobs and token selection (see sampler.h). */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void sampling_params_default(struct sampling_params *sp) {
    memset(sp, 0, sizeof *sp);
    sp->temperature = 1.0f;
    sp->top_k = 0;
    sp->top_p = 1.0f;
    sp->min_p = 0.0f;
    sp->repetition_penalty = 1.0f;
}

kv_status sampler_scratch_init(struct sampler_scratch *s, int n_vocab) {
    memset(s, 0, sizeof *s);
    s->n_vocab = n_vocab;
    s->prob = kv_malloc((size_t)n_vocab * sizeof *s->prob);
    s->cand = kv_malloc((size_t)n_vocab * sizeof *s->cand);
    s->count = kv_calloc((size_t)n_vocab, sizeof *s->count);
    s->seen = kv_calloc((size_t)n_vocab, sizeof *s->seen);
    if (!s->prob || !s->cand || !s->count || !s->seen) {
        sampler_scratch_free(s);
        return KV_ENOMEM;
    }
    return KV_OK;
}

void sampler_scratch_free(struct sampler_scratch *s) {
    free(s->prob);
    free(s->cand);
    free(s->count);
    free(s->seen);
    memset(s, 0, sizeof *s);
}

static void mark_seen(float *logits, int n_vocab, const int32_t *ids, int n, float rp,
                      uint8_t *seen) {
    for (int i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= n_vocab || seen[id]) continue;
        seen[id] = 1;
        float l = logits[id];
        logits[id] = l > 0.0f ? l / rp : l * rp;
    }
}

void sampler_apply_penalties(const struct sampling_params *sp, float *logits, int n_vocab,
                             const int32_t *prompt, int n_prompt, const int32_t *gen, int n_gen,
                             struct sampler_scratch *s) {
    if (sp->repetition_penalty > 0.0f && sp->repetition_penalty != 1.0f) {
        mark_seen(logits, n_vocab, prompt, n_prompt, sp->repetition_penalty, s->seen);
        mark_seen(logits, n_vocab, gen, n_gen, sp->repetition_penalty, s->seen);
        for (int i = 0; i < n_prompt; i++)
            if (prompt[i] >= 0 && prompt[i] < n_vocab) s->seen[prompt[i]] = 0;
        for (int i = 0; i < n_gen; i++)
            if (gen[i] >= 0 && gen[i] < n_vocab) s->seen[gen[i]] = 0;
    }
    if (sp->presence_penalty != 0.0f || sp->frequency_penalty != 0.0f) {
        for (int i = 0; i < n_gen; i++)
            if (gen[i] >= 0 && gen[i] < n_vocab) s->count[gen[i]]++;
        for (int i = 0; i < n_gen; i++) {
            int32_t id = gen[i];
            if (id < 0 || id >= n_vocab || s->count[id] == 0) continue;
            logits[id] -= (float)s->count[id] * sp->frequency_penalty + sp->presence_penalty;
            s->count[id] = 0; /* applied once per distinct id; leaves scratch zeroed */
        }
    }
}

void sampler_apply_mask(float *logits, int n_vocab, const uint64_t *allowed) {
    for (int w = 0; w * 64 < n_vocab; w++) {
        uint64_t bits = allowed[w];
        if (bits == ~0ull) continue;
        int end = w * 64 + 64 < n_vocab ? w * 64 + 64 : n_vocab;
        if (bits == 0) { /* the common case in narrow states: a plain (vectorized) fill */
            for (int i = w * 64; i < end; i++) logits[i] = -INFINITY;
            continue;
        }
        for (int i = w * 64; i < end; i++)
            if (!((bits >> (i & 63)) & 1)) logits[i] = -INFINITY;
    }
}

/* Sort order for candidates: logit desc, then id asc. */
static _Thread_local const float *g_sort_logits; /* qsort has no context argument */
static int cand_cmp(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    float lx = g_sort_logits[x], ly = g_sort_logits[y];
    if (lx > ly) return -1;
    if (lx < ly) return 1;
    return (x > y) - (x < y);
}

static inline bool better(float la, int32_t a, float lb, int32_t b) {
    return la > lb || (la == lb && a < b);
}

float sampler_logprob(const float *logits, int n_vocab, int32_t id, struct token_logprob *top,
                      int n_top) {
    float mx = -INFINITY;
    for (int i = 0; i < n_vocab; i++)
        if (logits[i] > mx) mx = logits[i];
    double sum = 0.0;
    for (int i = 0; i < n_vocab; i++) sum += exp((double)logits[i] - mx);
    double lse = (double)mx + log(sum);
    if (n_top > 0) {
        /* insertion into a sorted array of n_top: O(n_vocab * n_top) worst, n_top <= 20 */
        int n = 0;
        for (int i = 0; i < n_vocab; i++) {
            float l = logits[i];
            if (n == n_top && !better(l, i, logits[top[n - 1].id], top[n - 1].id)) continue;
            int j = n < n_top ? n++ : n - 1;
            while (j > 0 && better(l, i, logits[top[j - 1].id], top[j - 1].id)) {
                top[j] = top[j - 1];
                j--;
            }
            top[j].id = i;
            top[j].logprob = l; /* raw for now */
        }
        for (int j = 0; j < n; j++) top[j].logprob = (float)((double)top[j].logprob - lse);
    }
    return (float)((double)logits[id] - lse);
}

static int32_t argmax(const float *logits, int n_vocab) {
    int32_t best = 0;
    for (int i = 1; i < n_vocab; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

int32_t sampler_pick(const struct sampling_params *sp, const float *logits, int n_vocab,
                     kv_rng *rng, struct sampler_scratch *s) {
    if (sp->temperature <= 0.0f) return argmax(logits, n_vocab);

    int32_t *cand = s->cand;
    double *prob = s->prob; /* prob[i] belongs to cand[i] */
    int n = n_vocab;
    for (int i = 0; i < n; i++) cand[i] = i;
    bool need_sort = (sp->top_k > 0 && sp->top_k < n) || (sp->top_p > 0.0f && sp->top_p < 1.0f);
    if (need_sort) {
        g_sort_logits = logits;
        qsort(cand, (size_t)n, sizeof *cand, cand_cmp);
        if (sp->top_k > 0 && sp->top_k < n) n = sp->top_k;
    }
    float mx = logits[argmax(logits, n_vocab)];
    double inv_t = 1.0 / (double)sp->temperature;
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        prob[i] = exp(((double)logits[cand[i]] - mx) * inv_t);
        sum += prob[i];
    }
    if (sp->top_p > 0.0f && sp->top_p < 1.0f) {
        /* smallest prefix (in sorted order) whose mass reaches top_p; at least one token */
        double target = (double)sp->top_p * sum, acc = 0.0;
        int keep = n;
        for (int i = 0; i < n; i++) {
            acc += prob[i];
            if (acc >= target) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
        sum = acc;
    }
    if (sp->min_p > 0.0f) {
        /* the max logit has prob weight exp(0) = 1 (it survives top_k/top_p) */
        double thr = (double)sp->min_p;
        int w = 0;
        sum = 0.0;
        for (int i = 0; i < n; i++)
            if (prob[i] >= thr) {
                cand[w] = cand[i];
                prob[w] = prob[i];
                sum += prob[w];
                w++;
            }
        n = w;
    }
    double u = kv_rng_f64(rng) * sum, acc = 0.0;
    for (int i = 0; i < n; i++) {
        acc += prob[i];
        if (u < acc) return cand[i];
    }
    /* rounding: u landed on the total; take the last candidate with any weight (a candidate
     * of weight 0, e.g. masked to -inf by a grammar, is never returned) */
    for (int i = n - 1; i > 0; i--)
        if (prob[i] > 0.0) return cand[i];
    return cand[0];
}

int32_t sampler_sample(const struct sampling_params *sp, float *logits, int n_vocab,
                       const int32_t *prompt, int n_prompt, const int32_t *gen, int n_gen,
                       kv_rng *rng, struct sampler_scratch *s, struct token_logprob *chosen,
                       struct token_logprob *top, int n_top) {
    sampler_apply_penalties(sp, logits, n_vocab, prompt, n_prompt, gen, n_gen, s);
    int32_t id = sampler_pick(sp, logits, n_vocab, rng, s);
    if (chosen) {
        chosen->id = id;
        chosen->logprob = sampler_logprob(logits, n_vocab, id, top, n_top);
    }
    return id;
}
