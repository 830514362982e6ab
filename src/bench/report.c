/* bench report: statistics, the final table, JSON output, --compare, gnuplot charts. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"

double bench_percentile(const double *v, size_t n, double p) {
    if (n == 0) return NAN;
    if (n == 1) return v[0];
    double pos = p / 100.0 * (double)(n - 1);
    size_t lo = (size_t)floor(pos);
    if (lo >= n - 1) return v[n - 1];
    double fr = pos - (double)lo;
    return v[lo] + (v[lo + 1] - v[lo]) * fr;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static bench_dist dist_of(double *v, size_t n) {
    bench_dist d = {NAN, NAN, NAN, NAN, NAN, NAN, n};
    if (!n) return d;
    qsort(v, n, sizeof *v, cmp_d);
    double s = 0;
    for (size_t i = 0; i < n; i++) s += v[i];
    d.mean = s / (double)n;
    d.p50 = bench_percentile(v, n, 50);
    d.p90 = bench_percentile(v, n, 90);
    d.p99 = bench_percentile(v, n, 99);
    d.min = v[0];
    d.max = v[n - 1];
    return d;
}

/* Bumps the count of name in a (name, count) table of cap rows; ignores overflow. */
#define COUNT_NAME(tab, n, cap, nm)                                            \
    do {                                                                       \
        size_t i_;                                                             \
        for (i_ = 0; i_ < (n); i_++)                                           \
            if (!strcmp((tab)[i_].name, (nm))) break;                          \
        if (i_ < (n)) (tab)[i_].count++;                                       \
        else if ((n) < (cap)) {                                                \
            snprintf((tab)[n].name, sizeof (tab)[n].name, "%s", (nm));         \
            (tab)[n].count = 1;                                                \
            (n)++;                                                             \
        }                                                                      \
    } while (0)

void bench_summarize(const bench_result *r, bench_summary *s) {
    memset(s, 0, sizeof *s);
    s->requests = r->n_records;
    s->duration_s = r->duration_s;
    s->interrupted = r->interrupted;
    size_t nitl = 0;
    for (size_t i = 0; i < r->n_records; i++)
        if (r->records[i].n_chunks > 1) nitl += r->records[i].n_chunks - 1;
    size_t nn = r->n_records ? r->n_records : 1;
    double *ttft = calloc(nn, sizeof(double)), *tpot = calloc(nn, sizeof(double)),
           *e2e = calloc(nn, sizeof(double)), *itl = calloc(nitl ? nitl : 1, sizeof(double));
    size_t n_ttft = 0, n_tpot = 0, n_e2e = 0, n_itl = 0;
    long long pt_c = 0, cached_c = 0;
    bool any_cached = false;
    for (size_t i = 0; i < r->n_records; i++) {
        const bench_record *q = &r->records[i];
        if (q->error_kind) {
            s->failed++;
            COUNT_NAME(s->errors, s->n_error_kinds, BENCH_MAX_KINDS, q->error_kind);
        } else {
            s->ok++;
        }
        if (q->worker[0])
            COUNT_NAME(s->workers, s->n_workers, BENCH_MAX_WORKERS, q->worker);
        if (q->error_kind || !ttft) continue;
        int out = bench_record_output_tokens(q);
        s->output_tokens += out;
        if (q->prompt_tokens >= 0) s->prompt_tokens += q->prompt_tokens;
        if (q->cached_tokens >= 0) s->cached_tokens += q->cached_tokens;
        if (q->prompt_tokens >= 0 && q->cached_tokens >= 0) {
            pt_c += q->prompt_tokens;
            cached_c += q->cached_tokens;
            any_cached = true;
        }
        if (q->ttft_s >= 0) ttft[n_ttft++] = q->ttft_s;
        e2e[n_e2e++] = q->e2e_s;
        if (q->ttft_s >= 0 && out > 1) tpot[n_tpot++] = (q->e2e_s - q->ttft_s) / (out - 1);
        for (size_t k = 1; k < q->n_chunks; k++) itl[n_itl++] = q->chunk_s[k] - q->chunk_s[k - 1];
    }
    if (ttft && tpot && e2e && itl) {
        s->ttft = dist_of(ttft, n_ttft);
        s->tpot = dist_of(tpot, n_tpot);
        s->e2e = dist_of(e2e, n_e2e);
        s->itl = dist_of(itl, n_itl);
    }
    free(ttft), free(tpot), free(e2e), free(itl);
    s->cached_ratio = any_cached && pt_c > 0 ? (double)cached_c / (double)pt_c : NAN;
    if (s->duration_s > 0) {
        s->req_per_s = (double)s->ok / s->duration_s;
        s->output_tok_per_s = (double)s->output_tokens / s->duration_s;
        s->total_tok_per_s = (double)(s->output_tokens + s->prompt_tokens) / s->duration_s;
    }
}

static void dist_line(FILE *f, const char *name, const bench_dist *d) {
    if (!d->n) {
        fprintf(f, "  %-8s %10s %10s %10s %10s   (n=0)\n", name, "-", "-", "-", "-");
        return;
    }
    fprintf(f, "  %-8s %10.2f %10.2f %10.2f %10.2f   (n=%zu)\n", name, d->mean * 1e3, d->p50 * 1e3,
            d->p90 * 1e3, d->p99 * 1e3, d->n);
}

void bench_print_summary(FILE *f, const bench_summary *s) {
    fprintf(f, "==================== kvserve bench%s ====================\n",
            s->interrupted ? " (interrupted)" : "");
    fprintf(f, "  requests        %zu sent, %zu ok, %zu failed\n", s->requests, s->ok, s->failed);
    fprintf(f, "  duration        %.3f s\n", s->duration_s);
    fprintf(f, "  throughput      %.3f req/s, %.2f output tok/s, %.2f total tok/s\n", s->req_per_s,
            s->output_tok_per_s, s->total_tok_per_s);
    fprintf(f, "  tokens          %lld prompt, %lld output, %lld cached", s->prompt_tokens,
            s->output_tokens, s->cached_tokens);
    if (isnan(s->cached_ratio)) fprintf(f, " (cached ratio n/a: no cached_tokens in usage)\n");
    else fprintf(f, " (cached ratio %.1f%%)\n", s->cached_ratio * 100);
    fprintf(f, "  %-8s %10s %10s %10s %10s\n", "ms", "mean", "p50", "p90", "p99");
    dist_line(f, "TTFT", &s->ttft);
    dist_line(f, "TPOT", &s->tpot);
    dist_line(f, "ITL", &s->itl);
    dist_line(f, "E2E", &s->e2e);
    if (s->n_workers) {
        fprintf(f, "  workers        ");
        for (size_t i = 0; i < s->n_workers; i++)
            fprintf(f, " %s %zu (%.1f%%)", s->workers[i].name, s->workers[i].count,
                    s->requests ? 100.0 * (double)s->workers[i].count / (double)s->requests : 0.0);
        fprintf(f, "\n");
    }
    fprintf(f, "  errors         ");
    if (!s->n_error_kinds) fprintf(f, " none");
    for (size_t i = 0; i < s->n_error_kinds; i++) fprintf(f, " %s %zu", s->errors[i].name, s->errors[i].count);
    fprintf(f, "\n");
}

/* ---- JSON ---- */
static json_t *jnum(double v) { return isnan(v) || isinf(v) ? json_null() : json_real(v); }

static json_t *dist_json(const bench_dist *d) {
    json_t *o = json_object();
    json_object_set_new(o, "mean", jnum(d->mean * 1e3));
    json_object_set_new(o, "p50", jnum(d->p50 * 1e3));
    json_object_set_new(o, "p90", jnum(d->p90 * 1e3));
    json_object_set_new(o, "p99", jnum(d->p99 * 1e3));
    json_object_set_new(o, "min", jnum(d->min * 1e3));
    json_object_set_new(o, "max", jnum(d->max * 1e3));
    json_object_set_new(o, "n", json_integer((json_int_t)d->n));
    return o;
}

static json_t *summary_json(const bench_summary *s) {
    json_t *o = json_object();
    json_object_set_new(o, "requests", json_integer((json_int_t)s->requests));
    json_object_set_new(o, "ok", json_integer((json_int_t)s->ok));
    json_object_set_new(o, "failed", json_integer((json_int_t)s->failed));
    json_object_set_new(o, "interrupted", json_boolean(s->interrupted));
    json_object_set_new(o, "duration_s", jnum(s->duration_s));
    json_object_set_new(o, "request_throughput", jnum(s->req_per_s));
    json_object_set_new(o, "output_token_throughput", jnum(s->output_tok_per_s));
    json_object_set_new(o, "total_token_throughput", jnum(s->total_tok_per_s));
    json_object_set_new(o, "prompt_tokens", json_integer(s->prompt_tokens));
    json_object_set_new(o, "output_tokens", json_integer(s->output_tokens));
    json_object_set_new(o, "cached_tokens", json_integer(s->cached_tokens));
    json_object_set_new(o, "cached_ratio", jnum(s->cached_ratio));
    json_object_set_new(o, "ttft_ms", dist_json(&s->ttft));
    json_object_set_new(o, "tpot_ms", dist_json(&s->tpot));
    json_object_set_new(o, "itl_ms", dist_json(&s->itl));
    json_object_set_new(o, "e2e_ms", dist_json(&s->e2e));
    json_t *e = json_object(), *w = json_object();
    for (size_t i = 0; i < s->n_error_kinds; i++)
        json_object_set_new(e, s->errors[i].name, json_integer((json_int_t)s->errors[i].count));
    for (size_t i = 0; i < s->n_workers; i++)
        json_object_set_new(w, s->workers[i].name, json_integer((json_int_t)s->workers[i].count));
    json_object_set_new(o, "errors", e);
    json_object_set_new(o, "workers", w);
    return o;
}

static json_t *record_json(const bench_record *q) {
    json_t *o = json_object();
    json_object_set_new(o, "session", json_integer(q->session));
    json_object_set_new(o, "turn", json_integer(q->turn));
    json_object_set_new(o, "trace_session", json_integer(q->trace_session));
    json_object_set_new(o, "start_s", json_real(q->start_s));
    json_object_set_new(o, "ttft_ms", q->ttft_s >= 0 ? json_real(q->ttft_s * 1e3) : json_null());
    json_object_set_new(o, "e2e_ms", json_real(q->e2e_s * 1e3));
    json_t *ch = json_array(), *itl = json_array();
    for (size_t k = 0; k < q->n_chunks; k++) {
        json_array_append_new(ch, json_real(q->chunk_s[k] * 1e3));
        if (k) json_array_append_new(itl, json_real((q->chunk_s[k] - q->chunk_s[k - 1]) * 1e3));
    }
    json_object_set_new(o, "chunk_ms", ch);
    json_object_set_new(o, "itl_ms", itl);
    json_object_set_new(o, "chunks", json_integer((json_int_t)q->n_chunks));
    json_object_set_new(o, "output_tokens", json_integer(bench_record_output_tokens(q)));
    json_object_set_new(o, "prompt_tokens", q->prompt_tokens >= 0 ? json_integer(q->prompt_tokens) : json_null());
    json_object_set_new(o, "completion_tokens", q->completion_tokens >= 0 ? json_integer(q->completion_tokens) : json_null());
    json_object_set_new(o, "cached_tokens", q->cached_tokens >= 0 ? json_integer(q->cached_tokens) : json_null());
    json_object_set_new(o, "max_tokens", json_integer(q->max_tokens));
    json_object_set_new(o, "prompt_chars", json_integer((json_int_t)q->prompt_chars));
    json_object_set_new(o, "output_chars", json_integer((json_int_t)q->output_chars));
    json_object_set_new(o, "http_status", json_integer(q->http_status));
    json_object_set_new(o, "worker", q->worker[0] ? json_string(q->worker) : json_null());
    json_object_set_new(o, "error", q->error_kind ? json_string(q->error_kind) : json_null());
    json_object_set_new(o, "error_message", q->error_msg ? json_string(q->error_msg) : json_null());
    return o;
}

kv_status bench_write_json(const char *path, const bench_config *c, const bench_result *r,
                           const bench_summary *s, char *err, size_t errlen) {
    json_t *root = json_object(), *cfg = json_object(), *reqs = json_array();
    json_object_set_new(cfg, "url", json_string(c->url));
    json_object_set_new(cfg, "model", json_string(r->model ? r->model : ""));
    json_object_set_new(cfg, "api", json_string(c->api == BENCH_API_CHAT ? "chat" : "completions"));
    json_object_set_new(cfg, "concurrency", json_integer(c->concurrency));
    json_object_set_new(cfg, "request_rate", json_real(c->request_rate));
    json_object_set_new(cfg, "duration_s", json_real(c->duration_s));
    json_object_set_new(cfg, "num_sessions", json_integer((json_int_t)c->num_sessions));
    json_object_set_new(cfg, "max_tokens", json_integer(c->max_tokens));
    json_object_set_new(cfg, "ignore_eos", json_boolean(c->ignore_eos));
    json_object_set_new(cfg, "seed", json_integer((json_int_t)c->seed));
    json_object_set_new(root, "config", cfg);
    json_t *sj = summary_json(s);
    json_object_set_new(sj, "sessions_started", json_integer((json_int_t)r->sessions_started));
    json_object_set_new(sj, "sessions_completed", json_integer((json_int_t)r->sessions_completed));
    json_object_set_new(sj, "sessions_aborted", json_integer((json_int_t)r->sessions_aborted));
    json_object_set_new(root, "summary", sj);
    for (size_t i = 0; i < r->n_records; i++) json_array_append_new(reqs, record_json(&r->records[i]));
    json_object_set_new(root, "requests", reqs);
    int rc = json_dump_file(root, path, JSON_INDENT(1) | JSON_REAL_PRECISION(10));
    json_decref(root);
    if (rc) return kv_errf(KV_EIO, err, errlen, "%s: cannot write (%s)", path, strerror(errno));
    return KV_OK;
}

/* ---- compare ---- */
static double jget(json_t *sum, const char *a, const char *b) {
    json_t *v = json_object_get(sum, a);
    if (b) v = json_object_get(v, b);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

static const struct { const char *label, *k1, *k2; } cmp_rows[] = {
    {"requests", "requests", NULL}, {"failed", "failed", NULL},
    {"duration s", "duration_s", NULL}, {"req/s", "request_throughput", NULL},
    {"output tok/s", "output_token_throughput", NULL}, {"total tok/s", "total_token_throughput", NULL},
    {"output tokens", "output_tokens", NULL}, {"cached ratio", "cached_ratio", NULL},
    {"TTFT mean ms", "ttft_ms", "mean"}, {"TTFT p50 ms", "ttft_ms", "p50"},
    {"TTFT p90 ms", "ttft_ms", "p90"}, {"TTFT p99 ms", "ttft_ms", "p99"},
    {"TPOT mean ms", "tpot_ms", "mean"}, {"TPOT p50 ms", "tpot_ms", "p50"},
    {"TPOT p99 ms", "tpot_ms", "p99"}, {"ITL mean ms", "itl_ms", "mean"},
    {"ITL p50 ms", "itl_ms", "p50"}, {"ITL p99 ms", "itl_ms", "p99"},
    {"E2E mean ms", "e2e_ms", "mean"}, {"E2E p50 ms", "e2e_ms", "p50"},
    {"E2E p90 ms", "e2e_ms", "p90"}, {"E2E p99 ms", "e2e_ms", "p99"},
};

/* Runs script (in dir) with $GNUPLOT (default gnuplot), its output in dir/gnuplot.log. */
static kv_status run_gnuplot(const char *dir, const char *script, char *err, size_t errlen) {
    const char *gp = getenv("GNUPLOT");
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' %s > gnuplot.log 2>&1", dir, gp && *gp ? gp : "gnuplot", script);
    int rc = system(cmd);
    if (rc != 0) return kv_errf(KV_EIO, err, errlen, "gnuplot failed (status %d); see %s/gnuplot.log", rc, dir);
    return KV_OK;
}

/* The busiest worker's requests over the mean of the workers that got any (NAN: none). */
/* The busiest worker's requests over the mean of max(workers seen, pool) workers (a worker of
 * the pool that got nothing counts as 0; pool 0 = the workers seen). */
static double max_share(json_t *sum, int pool) {
    json_t *w = json_object_get(sum, "workers"), *v;
    const char *k;
    double tot = 0, mx = 0;
    int n = 0;
    json_object_foreach(w, k, v) {
        double x = json_number_value(v);
        tot += x, mx = x > mx ? x : mx, n++;
    }
    if (pool > n) n = pool;
    return n && tot > 0 ? mx / (tot / n) : NAN;
}

static const char *base_name(const char *p) {
    const char *s = strrchr(p, '/');
    return s ? s + 1 : p;
}

static void fmt_num(char *b, size_t n, double x) {
    if (isnan(x)) snprintf(b, n, "-");
    else snprintf(b, n, "%.3f", x);
}

/* The chart of an N-way comparison: bars of req/s, cached ratio, TTFT p50/p90 and the
 * busiest worker's share per file (labels = file names without .json). */
static kv_status compare_plot(const char *dir, const char *const *paths, json_t **sums, int n, int pool,
                              char *err, size_t errlen) {
    if (kv_mkdirs(dir)) return kv_errf(KV_EIO, err, errlen, "%s: cannot create directory", dir);
    char p[4096];
    snprintf(p, sizeof p, "%s/compare.dat", dir);
    FILE *f = fopen(p, "w");
    if (!f) return kv_errf(KV_EIO, err, errlen, "%s: %s", p, strerror(errno));
    fprintf(f, "# label req_per_s cached_ratio ttft_p50_ms ttft_p90_ms max_share_over_mean workers_used\n");
    for (int i = 0; i < n; i++) {
        char label[256];
        snprintf(label, sizeof label, "%s", base_name(paths[i]));
        char *dot = strstr(label, ".json");
        if (dot) *dot = 0;
        fprintf(f, "\"%s\" %.6g %.6g %.6g %.6g %.6g %zu\n", label, jget(sums[i], "request_throughput", NULL),
                jget(sums[i], "cached_ratio", NULL), jget(sums[i], "ttft_ms", "p50"),
                jget(sums[i], "ttft_ms", "p90"), max_share(sums[i], i ? pool : 0),
                json_object_size(json_object_get(sums[i], "workers")));
    }
    fclose(f);
    snprintf(p, sizeof p, "%s/compare.gp", dir);
    if (!(f = fopen(p, "w"))) return kv_errf(KV_EIO, err, errlen, "%s: %s", p, strerror(errno));
    fprintf(f, "# generated by kvserve bench --compare; run from this directory: gnuplot compare.gp\n"
               "set grid ytics; set style fill solid 0.6; set boxwidth 0.6; set xtics rotate by -30 noenhanced\n"
               "set key off; set yrange [0:*]\n"
               "do for [fmt in \"svg pngcairo\"] {\n"
               "  ext = fmt eq \"svg\" ? \"svg\" : \"png\"\n"
               "  if (fmt eq \"svg\") { set terminal svg size 1000,700 } else { set terminal pngcairo size 1000,700 }\n"
               "  set output \"compare.\".ext\n"
               "  set multiplot layout 2,2\n"
               "  set title \"requests/s\"; plot \"compare.dat\" using 0:2:xtic(1) with boxes\n"
               "  set title \"cached-token ratio\"; plot \"compare.dat\" using 0:3:xtic(1) with boxes\n"
               "  set title \"TTFT p50 / p90 (ms)\"; set boxwidth 0.3\n"
               "  plot \"compare.dat\" using ($0-0.15):4:xtic(1) with boxes, \"\" using ($0+0.15):5 with boxes\n"
               "  set boxwidth 0.6\n"
               "  set title \"busiest worker / mean share (workers used)\"\n"
               "  plot \"compare.dat\" using 0:6:xtic(1) with boxes, \"\" using 0:6:(sprintf(\"%%d\", $7)) with labels offset 0,0.7\n"
               "  unset multiplot\n"
               "  unset output\n"
               "}\n");
    fclose(f);
    return run_gnuplot(dir, "compare.gp", err, errlen);
}

kv_status bench_compare(FILE *f, const char *const *paths, int n, const char *plot_dir, int pool,
                        char *err, size_t errlen) {
    if (n < 2 || n > 16) return kv_errf(KV_EINVAL, err, errlen, "--compare takes 2 to 16 files");
    json_t *docs[16] = {0}, *sums[16] = {0};
    kv_status st = KV_OK;
    for (int i = 0; i < n && !st; i++) {
        json_error_t je;
        docs[i] = json_load_file(paths[i], 0, &je);
        if (!docs[i]) st = kv_errf(KV_EFORMAT, err, errlen, "%s: %s (line %d)", paths[i], je.text, je.line);
        else if (!json_is_object(sums[i] = json_object_get(docs[i], "summary")))
            st = kv_errf(KV_EFORMAT, err, errlen, "--compare: %s has no \"summary\" (kvserve bench --out)", paths[i]);
    }
    if (!st && n == 2) { /* the classic A / B / B/A table */
        const char *ua = json_string_value(json_object_get(json_object_get(docs[0], "config"), "url"));
        const char *ub = json_string_value(json_object_get(json_object_get(docs[1], "config"), "url"));
        fprintf(f, "A: %s (%s)\nB: %s (%s)\n", paths[0], ua ? ua : "?", paths[1], ub ? ub : "?");
        fprintf(f, "%-16s %14s %14s %10s\n", "metric", "A", "B", "B/A");
    } else if (!st) { /* one column per file, ratios against the first */
        for (int i = 0; i < n; i++) fprintf(f, "%c: %s\n", 'A' + i, paths[i]);
        fprintf(f, "%-16s", "metric");
        for (int i = 0; i < n; i++) fprintf(f, " %12c", 'A' + i);
        for (int i = 1; i < n; i++) fprintf(f, " %8c/A", 'A' + i);
        fprintf(f, "\n");
    }
    for (size_t r = 0; !st && r < sizeof cmp_rows / sizeof cmp_rows[0]; r++) {
        double x0 = jget(sums[0], cmp_rows[r].k1, cmp_rows[r].k2);
        fprintf(f, "%-16s", cmp_rows[r].label);
        for (int i = 0; i < n; i++) {
            char b[32];
            fmt_num(b, sizeof b, jget(sums[i], cmp_rows[r].k1, cmp_rows[r].k2));
            fprintf(f, n == 2 ? " %14s" : " %12s", b);
        }
        for (int i = 1; i < n; i++) {
            double y = jget(sums[i], cmp_rows[r].k1, cmp_rows[r].k2);
            char b[32] = "-";
            if (!isnan(x0) && !isnan(y) && x0 != 0) snprintf(b, sizeof b, "%.3f", y / x0);
            fprintf(f, n == 2 ? " %10s" : " %10s", b);
        }
        fprintf(f, "\n");
    }
    if (!st) {
        fprintf(f, "%-16s", "max share/mean");
        for (int i = 0; i < n; i++) {
            char b[32];
            fmt_num(b, sizeof b, max_share(sums[i], i ? pool : 0));
            fprintf(f, n == 2 ? " %14s" : " %12s", b);
        }
        fprintf(f, "\n");
    }
    if (!st && plot_dir) st = compare_plot(plot_dir, paths, sums, n, pool, err, errlen);
    for (int i = 0; i < n; i++) json_decref(docs[i]);
    return st;
}

/* ---- plots ---- */
kv_status bench_plot(const char *dir, const bench_result *r, char *err, size_t errlen) {
    if (kv_mkdirs(dir)) return kv_errf(KV_EIO, err, errlen, "%s: cannot create directory", dir);
    char p[4096];
    bench_summary s;
    bench_summarize(r, &s);
    /* TTFT CDF */
    snprintf(p, sizeof p, "%s/ttft.dat", dir);
    FILE *f = fopen(p, "w");
    if (!f) return kv_errf(KV_EIO, err, errlen, "%s: %s", p, strerror(errno));
    size_t n = 0;
    double *v = calloc(r->n_records + 1, sizeof *v);
    for (size_t i = 0; v && i < r->n_records; i++)
        if (!r->records[i].error_kind && r->records[i].ttft_s >= 0) v[n++] = r->records[i].ttft_s * 1e3;
    if (v) qsort(v, n, sizeof *v, cmp_d);
    for (size_t i = 0; i < n; i++) fprintf(f, "%.4f %.6f\n", v[i], (double)(i + 1) / (double)n);
    if (!n) fprintf(f, "0 0\n");
    free(v);
    fclose(f);
    /* per request over time: completion time, e2e, ttft */
    snprintf(p, sizeof p, "%s/requests.dat", dir);
    if (!(f = fopen(p, "w"))) return kv_errf(KV_EIO, err, errlen, "%s: %s", p, strerror(errno));
    fprintf(f, "# end_s e2e_ms ttft_ms ok\n");
    for (size_t i = 0; i < r->n_records; i++) {
        const bench_record *q = &r->records[i];
        fprintf(f, "%.4f %.4f %.4f %d\n", q->start_s + q->e2e_s, q->e2e_s * 1e3,
                q->ttft_s >= 0 ? q->ttft_s * 1e3 : NAN, q->error_kind == NULL);
    }
    fclose(f);
    /* throughput per 1 s bin (by completion time) */
    double dur = r->duration_s > 0 ? r->duration_s : 1;
    size_t nb = (size_t)ceil(dur) + 1;
    double *reqs = calloc(nb, sizeof *reqs), *toks = calloc(nb, sizeof *toks);
    snprintf(p, sizeof p, "%s/throughput.dat", dir);
    if (!reqs || !toks || !(f = fopen(p, "w"))) {
        free(reqs), free(toks);
        return kv_errf(KV_EIO, err, errlen, "%s: cannot write", p);
    }
    for (size_t i = 0; i < r->n_records; i++) {
        const bench_record *q = &r->records[i];
        if (q->error_kind) continue;
        size_t b = (size_t)floor(q->start_s + q->e2e_s);
        if (b >= nb) b = nb - 1;
        reqs[b] += 1;
        toks[b] += bench_record_output_tokens(q);
    }
    fprintf(f, "# t_s req_per_s output_tok_per_s\n");
    for (size_t b = 0; b < nb; b++) fprintf(f, "%zu %.0f %.0f\n", b, reqs[b], toks[b]);
    fclose(f);
    free(reqs), free(toks);
    snprintf(p, sizeof p, "%s/workers.dat", dir);
    if (!(f = fopen(p, "w"))) return kv_errf(KV_EIO, err, errlen, "%s: %s", p, strerror(errno));
    for (size_t i = 0; i < s.n_workers; i++) fprintf(f, "\"%s\" %zu\n", s.workers[i].name, s.workers[i].count);
    if (!s.n_workers) fprintf(f, "\"(no X-Kvserve-Worker)\" %zu\n", s.requests);
    fclose(f);
    snprintf(p, sizeof p, "%s/plots.gp", dir);
    if (!(f = fopen(p, "w"))) return kv_errf(KV_EIO, err, errlen, "%s: %s", p, strerror(errno));
    fprintf(f, "# generated by kvserve bench; run from this directory: gnuplot plots.gp\n"
               "set grid\n"
               "do for [fmt in \"svg pngcairo\"] {\n"
               "  ext = fmt eq \"svg\" ? \"svg\" : \"png\"\n"
               "  if (fmt eq \"svg\") { set terminal svg size 800,500 } else { set terminal pngcairo size 800,500 }\n"
               "  set output \"ttft_cdf.\".ext\n"
               "  set title \"TTFT CDF\"; set xlabel \"TTFT (ms)\"; set ylabel \"fraction of requests\"\n"
               "  set yrange [0:1]; plot \"ttft.dat\" using 1:2 with steps lw 2 title \"TTFT\"\n"
               "  set autoscale y\n"
               "  set output \"throughput.\".ext\n"
               "  set title \"Throughput over time (1 s bins)\"; set xlabel \"time (s)\"; set ylabel \"requests/s\"; set y2label \"output tokens/s\"\n"
               "  set y2tics; set ytics nomirror\n"
               "  plot \"throughput.dat\" using 1:2 with steps lw 2 title \"req/s\", \"\" using 1:3 axes x1y2 with steps lw 2 title \"output tok/s\"\n"
               "  unset y2tics; unset y2label; set ytics mirror\n"
               "  set output \"latency.\".ext\n"
               "  set title \"Latency over time (by completion)\"; set xlabel \"time (s)\"; set ylabel \"ms\"\n"
               "  plot \"requests.dat\" using 1:2 with points pt 7 ps 0.5 title \"E2E\", \"\" using 1:3 with points pt 7 ps 0.5 title \"TTFT\"\n"
               "  set output \"workers.\".ext\n"
               "  set title \"Per-worker share of requests\"; set xlabel \"\"; set ylabel \"requests\"\n"
               "  set style fill solid 0.6; set boxwidth 0.6; set yrange [0:*]\n"
               "  plot \"workers.dat\" using 0:2:xtic(1) with boxes title \"\"\n"
               "  set autoscale y; unset xtics; set xtics\n"
               "  unset output\n"
               "}\n");
    fclose(f);
    return run_gnuplot(dir, "plots.gp", err, errlen);
}
