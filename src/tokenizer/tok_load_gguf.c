/* tok_load_gguf: GGUF tokenizer.ggml.* metadata -> pipeline (as llama.cpp interprets it). */
#include <stdlib.h>
#include <string.h>

#include "../model/gguf.h"
#include "tok_internal.h"

/* HF ByteLevel's own split regex (use_regex = true). */
#define GPT2_REGEX "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
#define LLAMA3_REGEX                                                                                   \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| " \
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define QWEN2_REGEX                                                                                    \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| " \
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define TEKKEN_REGEX                                                                                   \
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"            \
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}| "     \
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define BLOOM_REGEX " ?[^(\\s|.,!?\xe2\x80\xa6\xe3\x80\x82\xef\xbc\x8c\xe3\x80\x81\xe0\xa5\xa4\xdb\x94\xd8\x8c)]+"
/* HF Punctuation pre-tokenizer: Unicode P* plus ASCII punctuation (Contiguous runs). */
#define PUNCT_REGEX "[\\p{P}!-/:-@\\[-`{-~]+"

/* The Hugging Face pre-tokenizer pipeline of each tokenizer.ggml.pre family (the names are
 * llama.cpp's; the steps are what the original tokenizer.json runs, which is what the
 * llama.cpp test vectors were generated with). Step codes:
 *   "R<regex>"  Split(regex, Isolated)     "B"  ByteLevel(use_regex = true)
 *   "b"         ByteLevel(use_regex=false) "D"  Digits(individual = false)
 *   "d"         Digits(individual = true)
 * Families not listed (deepseek-llm, deepseek-v3, viking, chameleon, ...) are refused. */
static const struct {
    const char *names;   /* '|'-separated aliases */
    const char *steps[6];
    bool ignore_merges;
} k_pre[] = {
    {"default|gpt-2|phi-2|mpt|olmo|jais|roberta-bpe|jina-es|jina-de|gigachat|jina-v1-en|jina-v2-es|jina-v2-de|"
     "jina-v2-code",
     {"B"}, false},
    {"llama3|llama-v3|llama-bpe|falcon3", {"R" LLAMA3_REGEX, "b"}, true},
    {"dbrx|smaug-bpe|chatglm-bpe", {"R" LLAMA3_REGEX, "b"}, false},
    {"qwen2|deepseek-r1-qwen|stablelm2|megrez", {"R" QWEN2_REGEX, "b"}, false},
    {"tekken", {"R" TEKKEN_REGEX, "b"}, true},
    {"deepseek-coder",
     {"R[\\r\\n]", "R\\s?\\p{L}+", "R\\s?\\p{P}+", "R[\\x{4E00}-\\x{9FA5}\\x{0800}-\\x{4E00}\\x{AC00}-\\x{D7FF}]+",
      "R\\p{N}", "b"},
     false},
    {"falcon", {"R" PUNCT_REGEX, "B", "D", "R[0-9][0-9][0-9]"}, false},
    {"starcoder|refact|command-r|smollm|codeshell|exaone|minerva-7b", {"d", "B"}, false},
    {"bloom|poro-chat|gpt3-finnish", {"R" BLOOM_REGEX, "b"}, false},
};

static bool name_in(const char *names, const char *s, size_t n) {
    for (const char *p = names;;) {
        const char *e = strchr(p, '|');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        if (l == n && !memcmp(p, s, n)) return true;
        if (!e) return false;
        p = e + 1;
    }
}

static kv_status add_pre(tokenizer_t *t, const char *code, char *err, size_t errlen) {
    void *p = kv_realloc(t->pre, (size_t)(t->n_pre + 1) * sizeof *t->pre);
    if (!p) return KV_ENOMEM;
    t->pre = p;
    struct pre_step *s = &t->pre[t->n_pre];
    memset(s, 0, sizeof *s);
    const char *re = NULL;
    switch (code[0]) {
    case 'R':
        s->kind = P_SPLIT;
        s->behavior = SB_ISOLATED;
        re = code + 1;
        break;
    case 'B': re = GPT2_REGEX; /* fall through */
    case 'b':
        s->kind = P_BYTELEVEL;
        t->bytelevel_input = true;
        break;
    case 'D': s->kind = P_DIGITS; break;
    case 'd':
        s->kind = P_DIGITS;
        s->individual_digits = true;
        break;
    default: return KV_EINTERNAL;
    }
    if (re && !(s->re = tok_regex_compile(re, strlen(re), err, errlen))) return KV_EFORMAT;
    t->n_pre++;
    return KV_OK;
}

static kv_status add_step(void **arr, int *n, size_t sz, void **out) {
    void *p = kv_realloc(*arr, (size_t)(*n + 1) * sz);
    if (!p) return KV_ENOMEM;
    *arr = p;
    *out = (char *)p + (size_t)*n * sz;
    memset(*out, 0, sz);
    (*n)++;
    return KV_OK;
}

#define SPACE_MARK "\xe2\x96\x81"

kv_status tok_load_gguf(tokenizer_t *t, const char *path, char *err, size_t errlen) {
    gguf_t *g;
    kv_status st = gguf_open(path, &g, err, errlen);
    if (st) return st;
    const char *model;
    size_t ml;
    enum gguf_type et;
    uint64_t n;
    if (!gguf_get_str(g, "tokenizer.ggml.model", &model, &ml)) {
        st = kv_errf(KV_ENOTFOUND, err, errlen, "%s: no tokenizer.ggml.model", path);
        goto done;
    }
    bool spm = ml == 5 && !memcmp(model, "llama", 5), bpe = ml == 4 && !memcmp(model, "gpt2", 4);
    if (!spm && !bpe) {
        st = kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: tokenizer.ggml.model '%.*s' not supported", path, (int)ml,
                     model);
        goto done;
    }
    if (!gguf_get_arr_info(g, "tokenizer.ggml.tokens", &et, &n) || et != GGUF_TYPE_STRING || n == 0 ||
        n > 50000000) {
        st = kv_errf(KV_EFORMAT, err, errlen, "%s: tokenizer.ggml.tokens missing or not strings", path);
        goto done;
    }
    if ((st = tok_vocab_alloc(t, (int)n))) goto done;
    const float *scores = NULL;
    const int32_t *types = NULL;
    uint64_t nn;
    if (gguf_get_arr_info(g, "tokenizer.ggml.scores", &et, &nn) && et == GGUF_TYPE_FLOAT32 && nn == n)
        scores = gguf_get_arr_data(g, "tokenizer.ggml.scores");
    if (gguf_get_arr_info(g, "tokenizer.ggml.token_type", &et, &nn) && (et == GGUF_TYPE_INT32 || et == GGUF_TYPE_UINT32) &&
        nn == n)
        types = gguf_get_arr_data(g, "tokenizer.ggml.token_type");
    t->added = kv_calloc(n, sizeof *t->added);
    if (!t->added) {
        st = KV_ENOMEM;
        goto done;
    }
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        size_t l;
        if (!gguf_get_arr_str(g, "tokenizer.ggml.tokens", i, &s, &l)) {
            st = kv_errf(KV_EFORMAT, err, errlen, "%s: token %llu unreadable", path, (unsigned long long)i);
            goto done;
        }
        if ((st = tok_vocab_set(t, (int)i, s, l))) goto done;
        struct tok_entry *e = &t->tok[i];
        e->flags = TF_MODEL;
        if (scores) memcpy(&e->score, &scores[i], sizeof(float));
        int32_t ty = 1;
        if (types) memcpy(&ty, &types[i], sizeof ty);
        /* 2 unknown, 3 control, 4 user-defined: matched in the text before the model */
        if (ty == 2 || ty == 3 || ty == 4) {
            struct added_token *a = &t->added[t->n_added++];
            a->id = (int)i;
            a->special = ty != 4;
            e->flags |= TF_ADDED | (ty != 4 ? TF_SPECIAL : 0);
        }
    }
    int64_t v;
    t->bos = gguf_get_int(g, "tokenizer.ggml.bos_token_id", &v) && v >= 0 && (uint64_t)v < n ? (int)v : -1;
    t->eos = gguf_get_int(g, "tokenizer.ggml.eos_token_id", &v) && v >= 0 && (uint64_t)v < n ? (int)v : -1;
    t->unk = gguf_get_int(g, "tokenizer.ggml.unknown_token_id", &v) && v >= 0 && (uint64_t)v < n ? (int)v : -1;
    bool add_bos = spm, add_eos = false, b;
    if (gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &b)) add_bos = b;
    if (gguf_get_bool(g, "tokenizer.ggml.add_eos_token", &b)) add_eos = b;
    if (add_bos && t->bos >= 0) t->prefix_ids[t->n_prefix++] = t->bos;
    if (add_eos && t->eos >= 0) t->suffix_ids[t->n_suffix++] = t->eos;
    t->add_bos = add_bos && t->bos >= 0;

    void *p;
    if (spm) {
        if (t->unk < 0) t->unk = 0;
        bool asp = true;
        if (gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &b)) asp = b;
        t->model = M_BPE_SCORE;
        t->byte_fallback = true;
        /* Whitespace is escaped to U+2581 only when the vocabulary uses that symbol: a
         * byte-only vocabulary (the demo model: <unk>, <s>, </s>, <0x00>..<0xFF>) maps every
         * string to exactly its bytes. */
        bool escape = false;
        for (int i = 0; i < t->n_tok && !escape; i++) {
            const char *ts = t->arena + ((uintptr_t)t->tok[i].s - 1);
            escape = t->tok[i].len >= 3 && memmem(ts, t->tok[i].len, SPACE_MARK, 3) != NULL;
        }
        struct norm_step *ns;
        if (asp) {
            if ((st = add_step((void **)&t->norm, &t->n_norm, sizeof *t->norm, &p))) goto done;
            ns = p;
            ns->kind = N_PREPEND;
            ns->alen = escape ? 3 : 1;
            if (!(ns->a = kv_strdup(escape ? SPACE_MARK : " "))) {
                st = KV_ENOMEM;
                goto done;
            }
        }
        if (escape) {
            if ((st = add_step((void **)&t->norm, &t->n_norm, sizeof *t->norm, &p))) goto done;
            ns = p;
            ns->kind = N_REPLACE;
            ns->alen = 1;
            ns->blen = 3;
            if (!(ns->a = kv_strdup(" ")) || !(ns->b = kv_strdup(SPACE_MARK))) {
                st = KV_ENOMEM;
                goto done;
            }
        }
        struct dec_step *ds;
        if (escape) {
            if ((st = add_step((void **)&t->dec, &t->n_dec, sizeof *t->dec, &p))) goto done;
            ds = p;
            ds->kind = D_REPLACE;
            ds->alen = 3;
            ds->blen = 1;
            if (!(ds->a = kv_strdup(SPACE_MARK)) || !(ds->b = kv_strdup(" "))) {
                st = KV_ENOMEM;
                goto done;
            }
        }
        if ((st = add_step((void **)&t->dec, &t->n_dec, sizeof *t->dec, &p))) goto done;
        ((struct dec_step *)p)->kind = D_BYTEFALLBACK;
        if ((st = add_step((void **)&t->dec, &t->n_dec, sizeof *t->dec, &p))) goto done;
        ((struct dec_step *)p)->kind = D_FUSE;
        if (asp) {
            if ((st = add_step((void **)&t->dec, &t->n_dec, sizeof *t->dec, &p))) goto done;
            ds = p;
            ds->kind = D_STRIP;
            ds->alen = 1;
            ds->start = 1;
            if (!(ds->a = kv_strdup(" "))) {
                st = KV_ENOMEM;
                goto done;
            }
        }
    } else {
        t->model = M_BPE_RANK;
        const char *pre = "default";
        size_t pl = 7;
        gguf_get_str(g, "tokenizer.ggml.pre", &pre, &pl);
        int found = -1;
        for (size_t i = 0; i < sizeof k_pre / sizeof k_pre[0] && found < 0; i++)
            if (name_in(k_pre[i].names, pre, pl)) found = (int)i;
        if (found < 0) {
            st = kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: tokenizer.ggml.pre '%.*s' not supported", path, (int)pl, pre);
            goto done;
        }
        for (int r = 0; r < 6 && k_pre[found].steps[r]; r++)
            if ((st = add_pre(t, k_pre[found].steps[r], err, errlen))) goto done;
        t->ignore_merges = k_pre[found].ignore_merges;
        if ((st = add_step((void **)&t->dec, &t->n_dec, sizeof *t->dec, &p))) goto done;
        ((struct dec_step *)p)->kind = D_BYTELEVEL;
        if (!gguf_get_arr_info(g, "tokenizer.ggml.merges", &et, &nn) || et != GGUF_TYPE_STRING) {
            st = kv_errf(KV_EFORMAT, err, errlen, "%s: gpt2 vocab without tokenizer.ggml.merges", path);
            goto done;
        }
        if ((st = pairmap_init(&t->merges, nn))) goto done;
        /* resolve merge strings through a temporary hash (the final one is built later) */
        if ((st = tok_finalize_map_only(t))) goto done;
        kv_buf cat;
        kv_buf_init(&cat);
        for (uint64_t i = 0; i < nn && !st; i++) {
            const char *s;
            size_t l;
            if (!gguf_get_arr_str(g, "tokenizer.ggml.merges", i, &s, &l)) {
                st = KV_EFORMAT;
                break;
            }
            const char *sp = memchr(s, ' ', l);
            if (!sp) continue;
            size_t al = (size_t)(sp - s);
            int a = tok_lookup(t, s, al), bb = tok_lookup(t, sp + 1, l - al - 1);
            cat.len = 0;
            if (kv_buf_append(&cat, s, al) || kv_buf_append(&cat, sp + 1, l - al - 1)) {
                st = KV_ENOMEM;
                break;
            }
            int m = tok_lookup(t, cat.data, cat.len);
            if (a >= 0 && bb >= 0 && m >= 0) st = pairmap_put(&t->merges, a, bb, (int32_t)i, m);
        }
        kv_buf_free(&cat);
        if (st) goto done;
    }
    const char *ct;
    size_t cl;
    if (gguf_get_str(g, "tokenizer.chat_template", &ct, &cl) && !(t->chat_template = kv_strndup(ct, cl)))
        st = KV_ENOMEM;
    if (gguf_get_int(g, "tokenizer.ggml.eot_token_id", &v) && v >= 0 && (uint64_t)v < n)
        t->eot = (int)v;
done:
    gguf_close(g);
    return st;
}
