/* bench traces: synthetic agentic generator, dataset readers, JSON-lines save/load. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"

void bench_trace_free(bench_trace *t) {
    if (!t) return;
    for (size_t i = 0; i < t->n_sessions; i++) {
        bench_session *s = &t->sessions[i];
        free(s->system);
        for (size_t j = 0; j < s->n_turns; j++) free(s->turns[j].user);
        free(s->turns);
    }
    free(t->sessions);
    memset(t, 0, sizeof *t);
}

/* ---- growable session list ---- */
typedef struct {
    bench_trace t;
    size_t cap;
} trace_builder;

static bench_session *tb_add(trace_builder *b) {
    if (b->t.n_sessions == b->cap) {
        size_t nc = b->cap ? b->cap * 2 : 64;
        bench_session *ns = kv_realloc(b->t.sessions, nc * sizeof *ns);
        if (!ns) return NULL;
        b->t.sessions = ns;
        b->cap = nc;
    }
    bench_session *s = &b->t.sessions[b->t.n_sessions++];
    memset(s, 0, sizeof *s);
    return s;
}

static bench_turn *sess_add_turn(bench_session *s, size_t *cap) {
    if (s->n_turns == *cap) {
        size_t nc = *cap ? *cap * 2 : 4;
        bench_turn *nt = kv_realloc(s->turns, nc * sizeof *nt);
        if (!nt) return NULL;
        s->turns = nt;
        *cap = nc;
    }
    bench_turn *t = &s->turns[s->n_turns++];
    memset(t, 0, sizeof *t);
    return t;
}

/* ---- synthetic ---- */

static const char *const words[] = {
    "the", "file", "function", "returns", "error", "value", "line", "config", "request",
    "server", "cache", "token", "model", "update", "status", "result", "check", "build",
    "test", "passed", "failed", "module", "input", "output", "path", "directory", "read",
    "write", "buffer", "size", "index", "query", "user", "agent", "tool", "call", "step",
    "plan", "next", "list", "items", "found", "match", "string", "number", "time", "memory",
    "block", "thread", "queue", "event", "handler", "option", "default", "version", "commit",
    "branch", "patch", "diff", "log", "trace", "report", "summary", "done"};
#define N_WORDS (sizeof words / sizeof words[0])

bench_synth_params bench_synth_defaults(void) {
    bench_synth_params p = {0};
    p.n_sessions = 20;
    p.system_words = 64;
    p.shared_fraction = 0.8;
    p.turns = 4;
    p.first_user_words = 16;
    p.tool_words = 32;
    p.output_tokens = 32;
    p.think_ms_mean = 0;
    p.seed = 1;
    return p;
}

static kv_status put_words(kv_buf *b, kv_rng *r, size_t n, size_t per_line) {
    for (size_t i = 0; i < n; i++) {
        const char *sep = i == 0 ? "" : (per_line && i % per_line == 0) ? "\n" : " ";
        if (kv_buf_puts(b, sep) || kv_buf_puts(b, words[kv_rng_next(r) % N_WORDS]))
            return KV_ENOMEM;
    }
    return KV_OK;
}

static char *buf_take(kv_buf *b) {
    char *s = kv_strdup(kv_buf_cstr(b));
    kv_buf_free(b);
    return s;
}

kv_status bench_trace_synth(const bench_synth_params *p, bench_trace *out, char *err,
                            size_t errlen) {
    memset(out, 0, sizeof *out);
    if (!p->n_sessions || !p->turns)
        return kv_errf(KV_EINVAL, err, errlen, "synthetic trace: sessions and turns must be >= 1");
    if (!(p->shared_fraction >= 0 && p->shared_fraction <= 1))
        return kv_errf(KV_EINVAL, err, errlen, "synthetic trace: shared fraction %g not in [0,1]",
                       p->shared_fraction);
    if (p->output_tokens < 1 || p->think_ms_mean < 0)
        return kv_errf(KV_EINVAL, err, errlen, "synthetic trace: output tokens must be >= 1 and think time >= 0");
    kv_rng r;
    kv_rng_seed(&r, p->seed);
    trace_builder tb = {0};
    char *shared = NULL;
    if (p->system_words) {
        kv_buf b;
        kv_buf_init(&b);
        if (kv_buf_puts(&b, "You are an agent. ") || put_words(&b, &r, p->system_words, 0)) goto oom;
        shared = buf_take(&b);
        if (!shared) goto oom;
    }
    for (size_t i = 0; i < p->n_sessions; i++) {
        bench_session *s = tb_add(&tb);
        if (!s) goto oom;
        double draw = kv_rng_f64(&r);
        if (p->system_words) {
            if (draw < p->shared_fraction) {
                s->system = kv_strdup(shared);
            } else {
                kv_buf b;
                kv_buf_init(&b);
                if (kv_buf_printf(&b, "You are agent %zu. ", i) ||
                    put_words(&b, &r, p->system_words, 0)) {
                    kv_buf_free(&b);
                    goto oom;
                }
                s->system = buf_take(&b);
            }
            if (!s->system) goto oom;
        }
        size_t cap = 0;
        for (size_t j = 0; j < p->turns; j++) {
            bench_turn *t = sess_add_turn(s, &cap);
            if (!t) goto oom;
            kv_buf b;
            kv_buf_init(&b);
            kv_status st = KV_OK;
            if (j == 0 && p->first_user_words) {
                st = kv_buf_puts(&b, "Task: ");
                if (!st) st = put_words(&b, &r, p->first_user_words, 0);
                if (!st && p->tool_words) st = kv_buf_puts(&b, "\n");
            }
            if (!st && p->tool_words) {
                st = kv_buf_printf(&b, "<tool_output id=\"call_%zu_%zu\">\n", i, j);
                if (!st) st = put_words(&b, &r, p->tool_words, 12);
                if (!st) st = kv_buf_puts(&b, "\n</tool_output>");
            }
            if (!st && b.len == 0) st = kv_buf_puts(&b, "Continue.");
            if (st) {
                kv_buf_free(&b);
                goto oom;
            }
            t->user = buf_take(&b);
            if (!t->user) goto oom;
            t->max_tokens = p->output_tokens;
            double u = kv_rng_f64(&r);
            t->think_ms = (j == 0 || p->think_ms_mean <= 0) ? 0
                                                           : (int)lround(-p->think_ms_mean * log(1.0 - u));
        }
    }
    free(shared);
    *out = tb.t;
    return KV_OK;
oom:
    free(shared);
    bench_trace_free(&tb.t);
    return kv_errf(KV_ENOMEM, err, errlen, "synthetic trace: out of memory");
}

/* ---- datasets ---- */

static kv_status add_single(trace_builder *tb, const char *user) {
    bench_session *s = tb_add(tb);
    if (!s) return KV_ENOMEM;
    size_t cap = 0;
    bench_turn *t = sess_add_turn(s, &cap);
    if (!t || !(t->user = kv_strdup(user))) return KV_ENOMEM;
    return KV_OK;
}

/* Reads a whole (optionally gzip) file. */
static kv_status read_any(const char *path, char **data, size_t *len, char *err, size_t errlen) {
    size_t pl = strlen(path);
    if (pl > 3 && !strcmp(path + pl - 3, ".gz")) {
        if (!kv_path_exists(path)) return kv_errf(KV_ENOTFOUND, err, errlen, "%s: not found", path);
        kv_buf cmd;
        kv_buf_init(&cmd);
        /* single-quote the path for the shell */
        kv_status st = kv_buf_puts(&cmd, "gzip -dc '");
        for (const char *c = path; !st && *c; c++)
            st = *c == '\'' ? kv_buf_puts(&cmd, "'\\''") : kv_buf_append(&cmd, c, 1);
        if (!st) st = kv_buf_puts(&cmd, "'");
        if (st) {
            kv_buf_free(&cmd);
            return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
        }
        FILE *f = popen(kv_buf_cstr(&cmd), "r");
        kv_buf_free(&cmd);
        if (!f) return kv_errf(KV_EIO, err, errlen, "%s: cannot run gzip -dc", path);
        kv_buf b;
        kv_buf_init(&b);
        char tmp[65536];
        size_t n;
        while ((n = fread(tmp, 1, sizeof tmp, f)) > 0)
            if (kv_buf_append(&b, tmp, n)) {
                pclose(f);
                kv_buf_free(&b);
                return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
            }
        int rc = pclose(f);
        if (rc != 0) {
            kv_buf_free(&b);
            return kv_errf(KV_EFORMAT, err, errlen, "%s: gzip -dc failed (status %d)", path, rc);
        }
        kv_buf_cstr(&b);
        *data = b.data ? b.data : kv_strdup("");
        *len = b.len;
        return *data ? KV_OK : KV_ENOMEM;
    }
    return kv_read_file(path, data, len, err, errlen);
}

static kv_status ds_mtbench(char *data, size_t max, trace_builder *tb, const char *path, char *err,
                            size_t errlen) {
    size_t lineno = 0;
    char *sv = NULL;
    for (char *line = strtok_r(data, "\n", &sv); line; line = strtok_r(NULL, "\n", &sv)) {
        lineno++;
        if (max && tb->t.n_sessions >= max) break;
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        json_t *turns = j ? json_object_get(j, "turns") : NULL;
        if (!json_is_array(turns) || json_array_size(turns) == 0) {
            json_decref(j);
            return kv_errf(KV_EFORMAT, err, errlen, "%s:%zu: expected an object with \"turns\"", path, lineno);
        }
        bench_session *s = tb_add(tb);
        if (!s) { json_decref(j); return KV_ENOMEM; }
        size_t cap = 0, k;
        json_t *v;
        json_array_foreach(turns, k, v) {
            if (!json_is_string(v)) continue;
            bench_turn *t = sess_add_turn(s, &cap);
            if (!t || !(t->user = kv_strdup(json_string_value(v)))) { json_decref(j); return KV_ENOMEM; }
        }
        json_decref(j);
        if (!s->n_turns) return kv_errf(KV_EFORMAT, err, errlen, "%s:%zu: no string turns", path, lineno);
    }
    return KV_OK;
}

/* hh-rlhf "chosen": "\n\nHuman: a\n\nAssistant: b\n\nHuman: c ..." -> user turns a, c. */
static kv_status ds_hh(char *data, size_t max, trace_builder *tb, const char *path, char *err,
                       size_t errlen) {
    size_t lineno = 0;
    char *sv = NULL;
    for (char *line = strtok_r(data, "\n", &sv); line; line = strtok_r(NULL, "\n", &sv)) {
        lineno++;
        if (max && tb->t.n_sessions >= max) break;
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        const char *txt = json_string_value(json_object_get(j, "chosen"));
        if (!txt) {
            json_decref(j);
            return kv_errf(KV_EFORMAT, err, errlen, "%s:%zu: expected an object with \"chosen\"", path, lineno);
        }
        bench_session *s = tb_add(tb);
        if (!s) { json_decref(j); return KV_ENOMEM; }
        size_t cap = 0;
        const char *H = "\n\nHuman: ", *A = "\n\nAssistant:";
        const char *p = strstr(txt, H);
        while (p) {
            p += strlen(H);
            const char *e = strstr(p, A);
            const char *next = strstr(p, H);
            if (!e || (next && next < e)) e = next;
            size_t n = e ? (size_t)(e - p) : strlen(p);
            bench_turn *t = sess_add_turn(s, &cap);
            if (!t || !(t->user = kv_strndup(p, n))) { json_decref(j); return KV_ENOMEM; }
            p = e ? strstr(e, H) : NULL;
        }
        json_decref(j);
        if (!s->n_turns) tb->t.n_sessions--; /* no human turn: skip */
    }
    return KV_OK;
}

static kv_status ds_sharegpt(const char *data, size_t max, trace_builder *tb, const char *path,
                             char *err, size_t errlen) {
    json_error_t je;
    json_t *j = json_loads(data, 0, &je);
    if (!json_is_array(j)) {
        json_decref(j);
        return kv_errf(KV_EFORMAT, err, errlen, "%s: expected a JSON array (%s, line %d)", path, je.text, je.line);
    }
    size_t i;
    json_t *v;
    kv_status st = KV_OK;
    json_array_foreach(j, i, v) {
        if (max && tb->t.n_sessions >= max) break;
        const char *u = json_string_value(json_object_get(json_array_get(json_object_get(v, "conversations"), 0), "value"));
        if (!u || !*u) continue;
        if ((st = add_single(tb, u))) break;
    }
    json_decref(j);
    return st;
}

/* Prompts of prompt_words words from seeded offsets (word boundaries) of a text file. */
static kv_status ds_text(const char *data, size_t len, size_t max, size_t prompt_words,
                         uint64_t seed, trace_builder *tb, const char *path, char *err, size_t errlen) {
    /* word starts */
    size_t nw = 0, cap = 0;
    size_t *ws = NULL;
    for (size_t i = 0; i < len; i++) {
        bool sp = data[i] == ' ' || data[i] == '\n' || data[i] == '\r' || data[i] == '\t';
        bool prev_sp = i == 0 || data[i - 1] == ' ' || data[i - 1] == '\n' || data[i - 1] == '\r' || data[i - 1] == '\t';
        if (!sp && prev_sp) {
            if (nw == cap) {
                cap = cap ? cap * 2 : 4096;
                size_t *n2 = kv_realloc(ws, cap * sizeof *n2);
                if (!n2) { free(ws); return KV_ENOMEM; }
                ws = n2;
            }
            ws[nw++] = i;
        }
    }
    if (nw <= prompt_words) {
        free(ws);
        return kv_errf(KV_EFORMAT, err, errlen, "%s: %zu words, fewer than --prompt-words %zu", path, nw, prompt_words);
    }
    kv_rng r;
    kv_rng_seed(&r, seed);
    kv_status st = KV_OK;
    for (size_t i = 0; i < max && !st; i++) {
        size_t w0 = kv_rng_next(&r) % (nw - prompt_words);
        size_t b = ws[w0], e = ws[w0 + prompt_words];
        while (e > b && (data[e - 1] == ' ' || data[e - 1] == '\n' || data[e - 1] == '\r')) e--;
        char *txt = kv_strndup(data + b, e - b);
        if (!txt) { st = KV_ENOMEM; break; }
        st = add_single(tb, txt);
        free(txt);
    }
    free(ws);
    return st;
}

kv_status bench_trace_dataset(const char *kind, const char *path, size_t max_sessions,
                              size_t prompt_words, uint64_t seed, bench_trace *out, char *err,
                              size_t errlen) {
    memset(out, 0, sizeof *out);
    const char *deffile = NULL;
    int k;
    if (!strcmp(kind, "mtbench")) k = 0, deffile = "fastchat_mt_bench_question.jsonl";
    else if (!strcmp(kind, "hh-rlhf")) k = 1, deffile = "hh-rlhf-harmless-base-test.jsonl.gz";
    else if (!strcmp(kind, "sharegpt")) k = 2, deffile = "mlenergy_ShareGPT_V3_filtered_1000.json";
    else if (!strcmp(kind, "war-and-peace")) k = 3, deffile = "war-and-peace.txt";
    else return kv_errf(KV_EINVAL, err, errlen, "unknown dataset '%s' (mtbench, hh-rlhf, sharegpt, war-and-peace)", kind);
    char defpath[4096];
    if (!path) {
        const char *d = getenv("KVSERVE_TEST_DATA");
        snprintf(defpath, sizeof defpath, "%s/datasets/%s", d && *d ? d : "../shared/data", deffile);
        path = defpath;
    }
    char *data = NULL;
    size_t len = 0;
    kv_status st = read_any(path, &data, &len, err, errlen);
    if (st) return st;
    trace_builder tb = {0};
    if (err && errlen) err[0] = 0;
    switch (k) {
    case 0: st = ds_mtbench(data, max_sessions, &tb, path, err, errlen); break;
    case 1: st = ds_hh(data, max_sessions, &tb, path, err, errlen); break;
    case 2: st = ds_sharegpt(data, max_sessions, &tb, path, err, errlen); break;
    default:
        if (!prompt_words) prompt_words = 256;
        st = ds_text(data, len, max_sessions ? max_sessions : 100, prompt_words, seed, &tb, path, err, errlen);
    }
    free(data);
    if (!st && tb.t.n_sessions == 0) st = kv_errf(KV_EFORMAT, err, errlen, "%s: no sessions", path);
    if (st) {
        if (st == KV_ENOMEM && err && errlen && !err[0]) kv_errf(st, err, errlen, "%s: out of memory", path);
        bench_trace_free(&tb.t);
        return st;
    }
    *out = tb.t;
    return KV_OK;
}

/* ---- save / load ---- */

char *bench_trace_to_jsonl(const bench_trace *t) {
    kv_buf b;
    kv_buf_init(&b);
    for (size_t i = 0; i < t->n_sessions; i++) {
        const bench_session *s = &t->sessions[i];
        json_t *o = json_object(), *turns = json_array();
        if (s->system) json_object_set_new(o, "system", json_string(s->system));
        for (size_t j = 0; j < s->n_turns; j++) {
            json_t *tj = json_object();
            json_object_set_new(tj, "user", json_string(s->turns[j].user));
            json_object_set_new(tj, "max_tokens", json_integer(s->turns[j].max_tokens));
            json_object_set_new(tj, "think_ms", json_integer(s->turns[j].think_ms));
            json_array_append_new(turns, tj);
        }
        json_object_set_new(o, "turns", turns);
        char *line = json_dumps(o, JSON_COMPACT | JSON_SORT_KEYS | JSON_ENSURE_ASCII);
        json_decref(o);
        if (!line || kv_buf_puts(&b, line) || kv_buf_puts(&b, "\n")) {
            free(line);
            kv_buf_free(&b);
            return NULL;
        }
        free(line);
    }
    if (!b.data) return kv_strdup("");
    return b.data;
}

kv_status bench_trace_save(const bench_trace *t, const char *path, char *err, size_t errlen) {
    char *s = bench_trace_to_jsonl(t);
    if (!s) return kv_errf(KV_ENOMEM, err, errlen, "trace: out of memory");
    FILE *f = fopen(path, "wb");
    if (!f) {
        free(s);
        return kv_errf(KV_EIO, err, errlen, "%s: %s", path, strerror(errno));
    }
    size_t n = strlen(s);
    bool ok = fwrite(s, 1, n, f) == n;
    ok = (fclose(f) == 0) && ok;
    free(s);
    return ok ? KV_OK : kv_errf(KV_EIO, err, errlen, "%s: write failed", path);
}

kv_status bench_trace_load(const char *path, bench_trace *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    char *data = NULL;
    size_t len = 0;
    kv_status st = kv_read_file(path, &data, &len, err, errlen);
    if (st) return st;
    trace_builder tb = {0};
    size_t lineno = 0;
    char *save = NULL;
    for (char *line = strtok_r(data, "\n", &save); line && !st; line = strtok_r(NULL, "\n", &save)) {
        lineno++;
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        json_t *turns = json_object_get(j, "turns");
        if (!json_is_array(turns) || !json_array_size(turns)) {
            st = kv_errf(KV_EFORMAT, err, errlen, "%s:%zu: expected {\"turns\":[...]} (%s)", path, lineno,
                         j ? "no turns" : je.text);
            json_decref(j);
            break;
        }
        bench_session *s = tb_add(&tb);
        if (!s) { json_decref(j); st = KV_ENOMEM; break; }
        const char *sys = json_string_value(json_object_get(j, "system"));
        if (sys && !(s->system = kv_strdup(sys))) st = KV_ENOMEM;
        size_t cap = 0, k;
        json_t *v;
        json_array_foreach(turns, k, v) {
            if (st) break;
            const char *u = json_string_value(json_object_get(v, "user"));
            if (!u) {
                st = kv_errf(KV_EFORMAT, err, errlen, "%s:%zu: turn %zu has no \"user\" string", path, lineno, k);
                break;
            }
            bench_turn *t = sess_add_turn(s, &cap);
            if (!t || !(t->user = kv_strdup(u))) { st = KV_ENOMEM; break; }
            t->max_tokens = (int)json_integer_value(json_object_get(v, "max_tokens"));
            t->think_ms = (int)json_integer_value(json_object_get(v, "think_ms"));
        }
        json_decref(j);
    }
    free(data);
    if (!st && !tb.t.n_sessions) st = kv_errf(KV_EFORMAT, err, errlen, "%s: empty trace", path);
    if (st) {
        if (st == KV_ENOMEM) kv_errf(st, err, errlen, "%s: out of memory", path);
        bench_trace_free(&tb.t);
        return st;
    }
    *out = tb.t;
    return KV_OK;
}
