/* tok_load_json: Hugging Face tokenizer.json (+ tokenizer_config.json) -> pipeline. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

#define GPT2_REGEX "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

/* Unused ids a tokenizer.json may leave below its largest id (see load_model). */
#define TOK_MAX_ID_GAP 65536

static const char *jstr(const json_t *o, const char *k) {
    const json_t *v = json_object_get(o, k);
    return json_is_string(v) ? json_string_value(v) : NULL;
}
static bool jbool(const json_t *o, const char *k, bool def) {
    const json_t *v = json_object_get(o, k);
    return json_is_boolean(v) ? json_is_true(v) : def;
}

static char *dupn(const char *s, size_t n) { return kv_strndup(s ? s : "", s ? n : 0); }

/* pattern object {"String": ".."} or {"Regex": ".."} */
static kv_status get_pattern(const json_t *p, const char **s, size_t *n, bool *is_re) {
    const json_t *v;
    if ((v = json_object_get(p, "String")) && json_is_string(v)) *is_re = false;
    else if ((v = json_object_get(p, "Regex")) && json_is_string(v)) *is_re = true;
    else return KV_EFORMAT;
    *s = json_string_value(v);
    *n = json_string_length(v);
    return KV_OK;
}

#define GROW(arr, n)                                                             \
    do {                                                                         \
        void *p_ = kv_realloc((arr), ((size_t)(n) + 1) * sizeof *(arr));         \
        if (!p_) return KV_ENOMEM;                                               \
        (arr) = p_;                                                              \
        memset(&(arr)[(n)], 0, sizeof *(arr));                                   \
    } while (0)

static kv_status parse_normalizer(tokenizer_t *t, const json_t *n, const char *path, char *err, size_t errlen) {
    if (!n || json_is_null(n)) return KV_OK;
    const char *type = jstr(n, "type");
    if (!type) return kv_errf(KV_EFORMAT, err, errlen, "%s: normalizer without type", path);
    if (!strcmp(type, "Sequence")) {
        const json_t *arr = json_object_get(n, "normalizers");
        size_t i;
        json_t *c;
        json_array_foreach(arr, i, c) {
            kv_status st = parse_normalizer(t, c, path, err, errlen);
            if (st) return st;
        }
        return KV_OK;
    }
    GROW(t->norm, t->n_norm);
    /* counted at once: a step that fails half-built (a compiled regex, then a bad field) is
     * freed with the tokenizer (found by tests/fuzz/fuzz_tokenizer_json) */
    struct norm_step *s = &t->norm[t->n_norm++];
    if (!strcmp(type, "NFC")) s->kind = N_NFC;
    else if (!strcmp(type, "NFD")) s->kind = N_NFD;
    else if (!strcmp(type, "NFKC")) s->kind = N_NFKC;
    else if (!strcmp(type, "NFKD")) s->kind = N_NFKD;
    else if (!strcmp(type, "Lowercase")) s->kind = N_LOWERCASE;
    else if (!strcmp(type, "Prepend")) {
        s->kind = N_PREPEND;
        const char *p = jstr(n, "prepend");
        s->alen = p ? strlen(p) : 0;
        if (!(s->a = dupn(p, s->alen))) return KV_ENOMEM;
    } else if (!strcmp(type, "Replace")) {
        s->kind = N_REPLACE;
        const char *p, *c = jstr(n, "content");
        size_t pl;
        bool re;
        if (get_pattern(json_object_get(n, "pattern"), &p, &pl, &re) || !c)
            return kv_errf(KV_EFORMAT, err, errlen, "%s: Replace normalizer without pattern/content", path);
        if (re) {
            if (!(s->re = tok_regex_compile(p, pl, err, errlen))) return KV_EFORMAT;
        } else {
            s->alen = pl;
            if (!(s->a = dupn(p, pl))) return KV_ENOMEM;
        }
        s->blen = strlen(c);
        if (!(s->b = dupn(c, s->blen))) return KV_ENOMEM;
    } else if (!strcmp(type, "Strip")) {
        s->kind = N_STRIP;
        s->left = jbool(n, "strip_left", true);
        s->right = jbool(n, "strip_right", true);
    } else {
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: normalizer type %s not supported", path, type);
    }
    return KV_OK;
}

static int parse_prepend_scheme(const json_t *n) {
    const char *ps = jstr(n, "prepend_scheme");
    if (ps) return !strcmp(ps, "always") ? 2 : !strcmp(ps, "first") ? 1 : 0;
    return jbool(n, "add_prefix_space", true) ? 2 : 0;
}

static kv_status parse_pre(tokenizer_t *t, const json_t *n, const char *path, char *err, size_t errlen) {
    if (!n || json_is_null(n)) return KV_OK;
    const char *type = jstr(n, "type");
    if (!type) return kv_errf(KV_EFORMAT, err, errlen, "%s: pre_tokenizer without type", path);
    if (!strcmp(type, "Sequence")) {
        const json_t *arr = json_object_get(n, "pretokenizers");
        size_t i;
        json_t *c;
        json_array_foreach(arr, i, c) {
            kv_status st = parse_pre(t, c, path, err, errlen);
            if (st) return st;
        }
        return KV_OK;
    }
    GROW(t->pre, t->n_pre);
    /* counted at once: a step that fails half-built (a compiled regex, then a bad field) is
     * freed with the tokenizer (found by tests/fuzz/fuzz_tokenizer_json) */
    struct pre_step *s = &t->pre[t->n_pre++];
    if (!strcmp(type, "Split")) {
        s->kind = P_SPLIT;
        const char *p;
        size_t pl;
        bool re;
        if (get_pattern(json_object_get(n, "pattern"), &p, &pl, &re))
            return kv_errf(KV_EFORMAT, err, errlen, "%s: Split without pattern", path);
        if (re) {
            if (!(s->re = tok_regex_compile(p, pl, err, errlen))) return KV_EFORMAT;
        } else {
            s->litlen = pl;
            if (!(s->lit = dupn(p, pl))) return KV_ENOMEM;
        }
        const char *b = jstr(n, "behavior");
        if (!b || !strcmp(b, "Isolated")) s->behavior = SB_ISOLATED;
        else if (!strcmp(b, "Removed")) s->behavior = SB_REMOVED;
        else if (!strcmp(b, "MergedWithPrevious")) s->behavior = SB_MERGED_PREV;
        else if (!strcmp(b, "MergedWithNext")) s->behavior = SB_MERGED_NEXT;
        else if (!strcmp(b, "Contiguous")) s->behavior = SB_CONTIGUOUS;
        else return kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: Split behavior %s", path, b);
        s->invert = jbool(n, "invert", false);
    } else if (!strcmp(type, "ByteLevel")) {
        s->kind = P_BYTELEVEL;
        s->add_prefix_space = jbool(n, "add_prefix_space", true);
        if (jbool(n, "use_regex", true) && !(s->re = tok_regex_compile(GPT2_REGEX, strlen(GPT2_REGEX), err, errlen)))
            return KV_EFORMAT;
        t->bytelevel_input = true;
    } else if (!strcmp(type, "Metaspace")) {
        s->kind = P_METASPACE;
        const char *r = jstr(n, "replacement");
        if (!r) r = "\xe2\x96\x81";
        s->repl_len = strlen(r);
        if (s->repl_len >= sizeof s->repl) return kv_errf(KV_EFORMAT, err, errlen, "%s: Metaspace replacement", path);
        memcpy(s->repl, r, s->repl_len);
        s->prepend = parse_prepend_scheme(n);
        s->split = jbool(n, "split", true);
    } else if (!strcmp(type, "Digits")) {
        s->kind = P_DIGITS;
        s->individual_digits = jbool(n, "individual_digits", false);
    } else {
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: pre_tokenizer type %s not supported", path, type);
    }
    return KV_OK;
}

static kv_status parse_decoder(tokenizer_t *t, const json_t *n, const char *path, char *err, size_t errlen) {
    if (!n || json_is_null(n)) return KV_OK;
    const char *type = jstr(n, "type");
    if (!type) return kv_errf(KV_EFORMAT, err, errlen, "%s: decoder without type", path);
    if (!strcmp(type, "Sequence")) {
        const json_t *arr = json_object_get(n, "decoders");
        size_t i;
        json_t *c;
        json_array_foreach(arr, i, c) {
            kv_status st = parse_decoder(t, c, path, err, errlen);
            if (st) return st;
        }
        return KV_OK;
    }
    GROW(t->dec, t->n_dec);
    /* counted at once: a step that fails half-built (a compiled regex, then a bad field) is
     * freed with the tokenizer (found by tests/fuzz/fuzz_tokenizer_json) */
    struct dec_step *s = &t->dec[t->n_dec++];
    if (!strcmp(type, "ByteLevel")) s->kind = D_BYTELEVEL;
    else if (!strcmp(type, "ByteFallback")) s->kind = D_BYTEFALLBACK;
    else if (!strcmp(type, "Fuse")) s->kind = D_FUSE;
    else if (!strcmp(type, "Replace")) {
        s->kind = D_REPLACE;
        const char *p, *c = jstr(n, "content");
        size_t pl;
        bool re;
        if (get_pattern(json_object_get(n, "pattern"), &p, &pl, &re) || re || !c)
            return kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: Replace decoder needs a String pattern", path);
        s->alen = pl;
        s->blen = strlen(c);
        if (!(s->a = dupn(p, pl)) || !(s->b = dupn(c, s->blen))) return KV_ENOMEM;
    } else if (!strcmp(type, "Strip")) {
        s->kind = D_STRIP;
        const char *c = jstr(n, "content");
        s->alen = c ? strlen(c) : 1;
        if (!(s->a = dupn(c ? c : " ", s->alen))) return KV_ENOMEM;
        s->start = (int)json_integer_value(json_object_get(n, "start"));
        s->stop = (int)json_integer_value(json_object_get(n, "stop"));
    } else if (!strcmp(type, "Metaspace")) {
        s->kind = D_METASPACE;
        const char *r = jstr(n, "replacement");
        if (!r) r = "\xe2\x96\x81";
        s->alen = strlen(r);
        if (!(s->a = dupn(r, s->alen))) return KV_ENOMEM;
        s->prepend = parse_prepend_scheme(n) != 0;
    } else {
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: decoder type %s not supported", path, type);
    }
    return KV_OK;
}

static kv_status parse_post(tokenizer_t *t, const json_t *n, const char *path, char *err, size_t errlen) {
    if (!n || json_is_null(n)) return KV_OK;
    const char *type = jstr(n, "type");
    if (!type) return KV_OK;
    if (!strcmp(type, "Sequence")) {
        size_t i;
        json_t *c;
        json_array_foreach(json_object_get(n, "processors"), i, c) {
            kv_status st = parse_post(t, c, path, err, errlen);
            if (st) return st;
        }
        return KV_OK;
    }
    if (!strcmp(type, "ByteLevel")) return KV_OK; /* offsets only */
    if (strcmp(type, "TemplateProcessing"))
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: post_processor %s not supported", path, type);
    const json_t *single = json_object_get(n, "single"), *sp = json_object_get(n, "special_tokens");
    bool after = false;
    size_t i;
    json_t *c;
    json_array_foreach(single, i, c) {
        if (json_object_get(c, "Sequence")) {
            after = true;
            continue;
        }
        const json_t *st = json_object_get(c, "SpecialToken");
        const char *name = st ? jstr(st, "id") : NULL;
        const json_t *ids = name ? json_object_get(json_object_get(sp, name), "ids") : NULL;
        size_t k;
        json_t *v;
        json_array_foreach(ids, k, v) {
            int32_t *arr = after ? t->suffix_ids : t->prefix_ids;
            int *cnt = after ? &t->n_suffix : &t->n_prefix;
            if (*cnt >= 4) return kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: template too long", path);
            /* checked here: an id outside the vocabulary would fail every request later */
            if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= t->n_tok)
                return kv_errf(KV_EFORMAT, err, errlen, "%s: post_processor special token %s: id outside the vocabulary "
                               "(%d tokens)", path, name, t->n_tok);
            arr[(*cnt)++] = (int32_t)json_integer_value(v);
        }
    }
    return KV_OK;
}

/* "bos_token": "<s>" or {"content": "<s>", ...} */
static const char *cfg_token(const json_t *cfg, const char *key) {
    const json_t *v = json_object_get(cfg, key);
    if (json_is_string(v)) return json_string_value(v);
    if (json_is_object(v)) return jstr(v, "content");
    return NULL;
}

static kv_status load_model(tokenizer_t *t, const json_t *root, const char *path, char *err, size_t errlen) {
    const json_t *model = json_object_get(root, "model");
    const char *type = jstr(model, "type");
    if (!model || (type && strcmp(type, "BPE")) || !json_is_object(json_object_get(model, "vocab")))
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: model type %s not supported (BPE only)", path,
                       type ? type : "?");
    const char *pfx = jstr(model, "continuing_subword_prefix"), *sfx = jstr(model, "end_of_word_suffix");
    if ((pfx && *pfx) || (sfx && *sfx))
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: BPE subword prefix/suffix not supported", path);
    const json_t *vocab = json_object_get(model, "vocab"), *added = json_object_get(root, "added_tokens");
    int64_t max_id = -1;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)vocab, k, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 50000000)
            return kv_errf(KV_EFORMAT, err, errlen, "%s: vocab entry %s has a bad id", path, k);
        if (json_integer_value(v) > max_id) max_id = json_integer_value(v);
    }
    size_t i;
    json_array_foreach(added, i, v) {
        const json_t *jid = json_object_get(v, "id");
        json_int_t id = json_integer_value(jid);
        if (!json_is_integer(jid) || id < 0 || id > 50000000 || !jstr(v, "content"))
            return kv_errf(KV_EFORMAT, err, errlen, "%s: added token %zu malformed (needs an integer id >= 0 and a "
                           "content string)", path, i);
        if (id > max_id) max_id = id;
    }
    if (max_id < 0) return kv_errf(KV_EFORMAT, err, errlen, "%s: the vocabulary is empty", path);
    /* The vocabulary is one dense array indexed by id, so a file whose ids leave a wide gap
     * (one entry with id 44,444,263 in a 14 KB file, found by the fuzzer) would cost gigabytes;
     * real tokenizers number their entries densely. */
    size_t n_entries = json_object_size(vocab) + json_array_size(added);
    if (max_id >= (int64_t)n_entries + TOK_MAX_ID_GAP)
        return kv_errf(KV_EFORMAT, err, errlen,
                       "%s: token ids are sparse (largest id %lld for %zu entries; at most %d unused ids)", path,
                       (long long)max_id, n_entries, TOK_MAX_ID_GAP);
    kv_status st = tok_vocab_alloc(t, (int)(max_id + 1));
    if (st) return st;
    json_object_foreach((json_t *)vocab, k, v) {
        int id = (int)json_integer_value(v);
        if ((st = tok_vocab_set(t, id, k, strlen(k)))) return st;
        t->tok[id].flags |= TF_MODEL;
    }
    t->added = kv_calloc(json_array_size(added) + 1, sizeof *t->added);
    if (!t->added) return KV_ENOMEM;
    json_array_foreach(added, i, v) {
        int id = (int)json_integer_value(json_object_get(v, "id"));
        const char *c = jstr(v, "content");
        if (!(t->tok[id].flags & TF_MODEL) && (st = tok_vocab_set(t, id, c, strlen(c)))) return st;
        struct added_token *a = &t->added[t->n_added++];
        a->id = id;
        a->special = jbool(v, "special", false);
        a->lstrip = jbool(v, "lstrip", false);
        a->rstrip = jbool(v, "rstrip", false);
        a->single_word = jbool(v, "single_word", false);
        a->normalized = jbool(v, "normalized", !a->special);
        t->tok[id].flags |= TF_ADDED | (a->special ? TF_SPECIAL : 0);
    }
    t->byte_fallback = jbool(model, "byte_fallback", false);
    t->ignore_merges = jbool(model, "ignore_merges", false);
    t->fuse_unk = jbool(model, "fuse_unk", false);
    const char *unk = jstr(model, "unk_token");
    if (unk) {
        const json_t *u = json_object_get(vocab, unk);
        t->unk = u ? (int)json_integer_value(u) : -1;
    }
    t->model = M_BPE_RANK;
    const json_t *merges = json_object_get(model, "merges");
    if ((st = pairmap_init(&t->merges, json_array_size(merges)))) return st;
    kv_buf cat;
    kv_buf_init(&cat);
    json_array_foreach(merges, i, v) {
        const char *a, *b;
        size_t al, bl;
        if (json_is_string(v)) {
            a = json_string_value(v);
            const char *sp = strchr(a, ' ');
            if (!sp) {
                kv_buf_free(&cat);
                return kv_errf(KV_EFORMAT, err, errlen, "%s: merge %zu has no space", path, i);
            }
            al = (size_t)(sp - a);
            b = sp + 1;
            bl = strlen(b);
        } else if (json_is_array(v) && json_array_size(v) == 2 && json_is_string(json_array_get(v, 0)) &&
                   json_is_string(json_array_get(v, 1))) {
            a = json_string_value(json_array_get(v, 0));
            al = json_string_length(json_array_get(v, 0));
            b = json_string_value(json_array_get(v, 1));
            bl = json_string_length(json_array_get(v, 1));
        } else {
            kv_buf_free(&cat);
            return kv_errf(KV_EFORMAT, err, errlen, "%s: merge %zu malformed", path, i);
        }
        cat.len = 0;
        if (kv_buf_append(&cat, a, al) || kv_buf_append(&cat, b, bl)) {
            kv_buf_free(&cat);
            return KV_ENOMEM;
        }
        const json_t *ja = json_object_getn(vocab, a, al), *jb = json_object_getn(vocab, b, bl),
                     *jm = json_object_getn(vocab, cat.data, cat.len);
        if (!ja || !jb || !jm) continue; /* HF rejects such files; we ignore the merge */
        pairmap_put(&t->merges, (int32_t)json_integer_value(ja), (int32_t)json_integer_value(jb), (int32_t)i,
                    (int32_t)json_integer_value(jm));
    }
    kv_buf_free(&cat);
    return KV_OK;
}

kv_status tok_load_json(tokenizer_t *t, const char *json_path, const char *config_path, char *err, size_t errlen) {
    json_error_t je;
    json_t *root = json_load_file(json_path, 0, &je);
    if (!root)
        return kv_errf(kv_path_exists(json_path) ? KV_EFORMAT : KV_ENOTFOUND, err, errlen, "%s:%d: %s", json_path,
                       je.line, je.text);
    json_t *cfg = NULL;
    if (config_path && !(cfg = json_load_file(config_path, JSON_DECODE_INT_AS_REAL, &je))) {
        json_decref(root);
        return kv_errf(KV_EFORMAT, err, errlen, "%s:%d: %s", config_path, je.line, je.text);
    }
    kv_status st = load_model(t, root, json_path, err, errlen);
    if (!st) st = parse_normalizer(t, json_object_get(root, "normalizer"), json_path, err, errlen);
    if (!st) st = parse_pre(t, json_object_get(root, "pre_tokenizer"), json_path, err, errlen);
    if (!st) st = parse_decoder(t, json_object_get(root, "decoder"), json_path, err, errlen);
    if (!st) st = parse_post(t, json_object_get(root, "post_processor"), json_path, err, errlen);
    if (!st) {
        /* BOS/EOS: tokenizer_config.json names them; else the post-processor's first id. */
        const char *bos = cfg ? cfg_token(cfg, "bos_token") : NULL, *eos = cfg ? cfg_token(cfg, "eos_token") : NULL;
        st = tok_finalize_map_only(t);
        if (bos) t->bos = tok_lookup(t, bos, strlen(bos));
        if (eos) t->eos = tok_lookup(t, eos, strlen(eos));
        if (t->bos < 0 && t->n_prefix > 0) t->bos = t->prefix_ids[0];
        if (t->eos < 0 && !cfg) { /* no config: a lone "</s>" / "<|endoftext|>" */
            const char *names[] = {"</s>", "<|endoftext|>", "<|end_of_text|>"};
            for (int n = 0; n < 3 && t->eos < 0; n++) {
                int id = tok_lookup(t, names[n], strlen(names[n]));
                if (id >= 0 && (t->tok[id].flags & TF_SPECIAL)) t->eos = id;
            }
        }
        const json_t *ab = cfg ? json_object_get(cfg, "add_bos_token") : NULL;
        if (json_is_boolean(ab)) {
            bool want = json_is_true(ab);
            bool has = t->n_prefix > 0 && t->prefix_ids[0] == t->bos;
            if (want && !has && t->bos >= 0 && t->n_prefix < 4) {
                memmove(t->prefix_ids + 1, t->prefix_ids, (size_t)t->n_prefix * sizeof(int32_t));
                t->prefix_ids[0] = t->bos;
                t->n_prefix++;
            } else if (!want && has) {
                memmove(t->prefix_ids, t->prefix_ids + 1, (size_t)(t->n_prefix - 1) * sizeof(int32_t));
                t->n_prefix--;
            }
        }
        t->add_bos = t->bos >= 0 && t->n_prefix > 0 && t->prefix_ids[0] == t->bos;
        const json_t *ct = cfg ? json_object_get(cfg, "chat_template") : NULL;
        const char *tmpl = NULL;
        if (json_is_string(ct)) tmpl = json_string_value(ct);
        else if (json_is_array(ct)) {
            size_t i;
            json_t *e;
            json_array_foreach(ct, i, e) if (jstr(e, "name") && !strcmp(jstr(e, "name"), "default")) tmpl = jstr(e, "template");
        }
        if (tmpl && !(t->chat_template = kv_strdup(tmpl))) st = KV_ENOMEM;
    }
    json_decref(root);
    json_decref(cfg);
    return st;
}
