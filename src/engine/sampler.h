/*
 * sampler (engine-internal): turns one row of logits into the next token of one request.
 *
 * Pipeline, per token (all state is per request, so the result never depends on what
 * else was in the batch):
 *
 *   logits --repetition_penalty (prompt+generated, CTRL/HF: l>0 ? l/rp : l*rp)
 *          --presence/frequency (generated only, OpenAI: l -= count*freq + (count>0)*pres)
 *          --> penalised logits  ==> logprobs = log_softmax(penalised)   (reported)
 *          --temperature == 0 --> argmax (ties -> lowest id)
 *          --else /T --> top_k --> top_p --> min_p --> draw with the request's RNG
 *
 * The RNG draws exactly one number per non-greedy token, so a request's output depends
 * only on (seed, prompt, params, logits).
 *
 * A backend with backend_ops.forward_sample (CUDA) runs this pipeline on the device instead
 * (unless engine_config.host_sampling): the engine takes the draw from the request's RNG
 * before the step (the same stream), and the penalised logits and greedy ids are bitwise
 * these; sums of probabilities and the log-sum-exp are reduced in another order there, so a
 * logprob can differ in its last bits and a draw within rounding of a boundary between two
 * candidates can pick the neighbour (backend_cuda.h; never seen in test_cuda_ops).
 */
#ifndef KV_ENGINE_SAMPLER_H
#define KV_ENGINE_SAMPLER_H

#include "engine.h"

/* Reusable scratch for one sampler call at a time (engine thread only). All arrays have
 * n_vocab entries; count/seen are all-zero between calls. */
struct sampler_scratch {
    int n_vocab;
    double *prob;        /* (n_vocab) */
    int32_t *cand;       /* (n_vocab) candidate ids */
    int32_t *count;      /* (n_vocab) generated-token counts, zero between calls */
    uint8_t *seen;       /* (n_vocab) prompt+generated membership, zero between calls */
};
/* KV_ENOMEM on failure (nothing left allocated). */
kv_status sampler_scratch_init(struct sampler_scratch *s, int n_vocab);
void sampler_scratch_free(struct sampler_scratch *s);

/* Applies repetition, presence and frequency penalties to logits[0..n_vocab) in place.
 * prompt: (n_prompt) ids, gen: (n_gen) generated ids; ids outside the vocab are ignored. */
void sampler_apply_penalties(const struct sampling_params *sp, float *logits, int n_vocab,
                             const int32_t *prompt, int n_prompt, const int32_t *gen, int n_gen,
                             struct sampler_scratch *s);

/* Constrained decoding: logits[i] = -inf for every i whose bit is clear in allowed
 * (ceil(n_vocab / 64) words, bit i of word i / 64). Applied before sampler_sample, so greedy,
 * temperature, top-k/p, min-p and the penalties all act on the allowed tokens only, and the
 * reported logprobs are the distribution over them. */
void sampler_apply_mask(float *logits, int n_vocab, const uint64_t *allowed);

/* log_softmax of logits at id, and (if n_top > 0) the n_top most likely ids with their
 * logprobs, sorted by logprob desc (ties -> lower id). n_top <= n_vocab. */
float sampler_logprob(const float *logits, int n_vocab, int32_t id, struct token_logprob *top,
                      int n_top);

/* Picks a token from (already penalised) logits: greedy if sp->temperature == 0, else
 * temperature / top_k / top_p / min_p then one draw from rng. logits is not modified. */
int32_t sampler_pick(const struct sampling_params *sp, const float *logits, int n_vocab,
                     kv_rng *rng, struct sampler_scratch *s);

/* Full pipeline: penalties (in place on logits), then pick; if chosen != NULL fills the
 * chosen token's logprob, and top[0..n_top) the alternatives. Returns the token id. */
int32_t sampler_sample(const struct sampling_params *sp, float *logits, int n_vocab,
                       const int32_t *prompt, int n_prompt, const int32_t *gen, int n_gen,
                       kv_rng *rng, struct sampler_scratch *s, struct token_logprob *chosen,
                       struct token_logprob *top, int n_top);

#endif
