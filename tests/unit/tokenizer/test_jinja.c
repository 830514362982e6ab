/* Jinja interpreter: error contract (line/column, named construct), limits, and fuzzing:
 * random token soups and mutations of the real chat templates must parse+render to either a
 * result or an error message, never a crash (run under -DKVSERVE_SANITIZE=ON for ASan/UBSan).
 * Rendering semantics are checked against @huggingface/jinja by tests/e2e/test_chat_template.sh. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <jansson.h>

#include "test_util.h"
#include "tokenizer/jinja/jinja.h"
#include "tokenizer/tokenizer.h"

static json_t *conv(void) {
    return json_pack("{s:[{s:s,s:s},{s:s,s:s},{s:s,s:n,s:[{s:s,s:{s:s,s:s}}]},{s:s,s:s}],s:b,s:s,s:s,s:[{s:s}]}",
                     "messages", "role", "system", "content", "Be brief.", "role", "user", "content", " Hi there \n",
                     "role", "assistant", "content", "tool_calls", "type", "function", "function", "name", "f",
                     "arguments", "{}", "role", "tool", "content", "<tool_response>42</tool_response>",
                     "add_generation_prompt", 1, "bos_token", "<s>", "eos_token", "</s>", "tools", "name", "f");
}

/* parse + render; returns the status, checks the error contract */
static kv_status run(const char *src, size_t len, const json_t *ctx, char **out) {
    jinja_template_t *t;
    char err[256] = "";
    *out = NULL;
    kv_status st = jinja_parse(src, len, &t, err, sizeof err);
    if (st) {
        assert_true(st == KV_EINVAL || st == KV_ETOOLONG);
        assert_true(strncmp(err, "jinja: ", 7) == 0);
        return st;
    }
    size_t n = 0;
    st = jinja_render(t, ctx, out, &n, err, sizeof err);
    if (st) {
        assert_true(st == KV_EINVAL || st == KV_ETOOLONG);
        assert_true(strncmp(err, "jinja: ", 7) == 0);
        assert_null(*out);
    } else {
        assert_non_null(*out);
        assert_int_equal(strlen(*out) <= n, 1);
    }
    jinja_free(t);
    return st;
}

static void expect_error(const char *src, const char *needle) {
    jinja_template_t *t;
    char err[256] = "";
    json_t *ctx = conv();
    kv_status st = jinja_parse(src, strlen(src), &t, err, sizeof err);
    if (st == KV_OK) {
        char *out = NULL;
        st = jinja_render(t, ctx, &out, NULL, err, sizeof err);
        jinja_free(t);
        free(out);
    }
    json_decref(ctx);
    if (st == KV_OK || !strstr(err, needle)) fail_msg("template %s: expected error containing '%s', got '%s'", src, needle, err);
}

static void test_errors(void **s) {
    (void)s;
    expect_error("a\n  {% while x %}", "line 2, column 6: unsupported statement: while");
    expect_error("{{ messages | nosuchfilter }}", "line 1, column 15: unknown filter 'nosuchfilter' for an array");
    expect_error("{% if true %}never closed", "missing {% endif %}");
    expect_error("{{ 'abc }}", "unterminated string literal");
    expect_error("{{ x is nosuchtest }}", "unknown test: nosuchtest");
    expect_error("{{ raise_exception('bad ' ~ messages|length) }}", "raise_exception: bad 4");
    expect_error("{{ messages[0].content.nosuch() }}", "not a function");
    expect_error("{{ undefined_var.attr }}", "cannot read property 'attr'");
    expect_error("{% break %}", "outside of a loop");
    expect_error("{{ 1 + none }}", "null values");
    expect_error("{# unterminated comment", "missing end of comment");
    expect_error("{{ (((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((("
                 "((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((("
                 "((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((1 }}",
                 "nested too deeply");
}

static void test_limits(void **s) {
    (void)s;
    char *out;
    json_t *ctx = conv();
    const char *loops = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}";
    assert_int_equal(run(loops, strlen(loops), ctx, &out), KV_ETOOLONG);
    const char *rec = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
    assert_int_equal(run(rec, strlen(rec), ctx, &out), KV_EINVAL);
    const char *ok = "{% for m in messages %}{{ loop.index }}{{ m.role[0] }}{% endfor %}";
    assert_int_equal(run(ok, strlen(ok), ctx, &out), KV_OK);
    assert_string_equal(out, "1s2u3a4t");
    free(out);
    json_decref(ctx);
}

static const char *k_frags[] = {
    "{{", "}}", "{%", "%}", "{#", "#}", "{%-", "-%}", "{{-", "-}}", " ", "\n", "x", "messages", "m", "loop",
    "for", "in", "endfor", "if", "elif", "else", "endif", "set", "endset", "macro", "endmacro", "call", "endcall",
    "filter", "endfilter", "break", "continue", "=", "==", "!=", "<", ">", "+", "-", "~", "*", "**", "/", "//",
    "%", "(", ")", "[", "]", "{", "}", ",", ".", ":", "|", "'", "\"", "'a'", "\"b\\n\"", "0", "1", "-1", "2.5",
    "not", "and", "or", "is", "defined", "none", "true", "string", "trim", "tojson", "length", "join", "items",
    "map", "selectattr", "default", "namespace", "ns", "ns.a", "range", "raise_exception", "content", "role",
    "[::-1]", "[1:]", ".split", ".strip()", "upper", "replace", "x if y else z", "\\", "\xc3\xa9", "\xff", "\0",
    "*args", "**kw", "caller", "varargs", "kwargs", "strftime_now", "%Y",
};

static void fuzz_one(const char *src, size_t len, const json_t *ctx) {
    char *out = NULL;
    run(src, len, ctx, &out);
    free(out);
}

static void test_fuzz_random(void **s) {
    (void)s;
    kv_rng r;
    kv_rng_seed(&r, 42);
    json_t *ctx = conv();
    size_t nf = sizeof k_frags / sizeof k_frags[0];
    char buf[2048];
    for (int it = 0; it < 4000; it++) {
        size_t len = 0;
        int n = 1 + (int)(kv_rng_next(&r) % 40);
        for (int k = 0; k < n; k++) {
            const char *f = k_frags[kv_rng_next(&r) % nf];
            size_t fl = f[0] ? strlen(f) : 1; /* "\0" fragment: one NUL byte */
            if (len + fl >= sizeof buf) break;
            memcpy(buf + len, f, fl);
            len += fl;
        }
        fuzz_one(buf, len, ctx);
    }
    /* well-formed skeletons with random expressions inside */
    static const char *skel[] = {"{{ %s }}", "{%% if %s %%}a{%% else %%}b{%% endif %%}", "{%% for x in %s %%}{{ x }}{%% endfor %%}",
                                 "{%% set y = %s %%}{{ y }}", "{{ messages | %s }}", "{{ %s | tojson }}"};
    for (int it = 0; it < 4000; it++) {
        char expr[512];
        size_t len = 0;
        int n = 1 + (int)(kv_rng_next(&r) % 8);
        for (int k = 0; k < n; k++) {
            const char *f = k_frags[10 + kv_rng_next(&r) % (nf - 10)];
            if (!f[0]) continue;
            size_t fl = strlen(f);
            if (len + fl + 2 >= sizeof expr) break;
            memcpy(expr + len, f, fl);
            len += fl;
            expr[len++] = ' ';
        }
        expr[len] = 0;
        int w = snprintf(buf, sizeof buf, skel[kv_rng_next(&r) % 6], expr);
        fuzz_one(buf, (size_t)w, ctx);
    }
    json_decref(ctx);
}

static void test_fuzz_mutated(void **s) {
    (void)s;
    static const char *files[] = {"tokenizers/qwen3/tokenizer_config.json", "tokenizers/llama3/tokenizer_config.json",
                                  "chat-templates/deepseek_v3.tokenizer_config.json",
                                  "chat-templates/gemma3.tokenizer_config.json",
                                  "chat-templates/llama3_1.tokenizer_config.json"};
    json_t *ctx = conv();
    kv_rng r;
    kv_rng_seed(&r, 7);
    int used = 0;
    for (size_t fi = 0; fi < sizeof files / sizeof files[0]; fi++) {
        char path[1024];
        if (!test_data_path(path, sizeof path, files[fi])) continue;
        json_t *cfg = json_load_file(path, JSON_DECODE_INT_AS_REAL, NULL);
        assert_non_null(cfg);
        const char *src = json_string_value(json_object_get(cfg, "chat_template"));
        assert_non_null(src);
        size_t n = strlen(src);
        char *out;
        run(src, n, ctx, &out); /* the null content of the tool-call turn is an error for some */
        free(out);
        char *m = malloc(n + 64);
        for (int it = 0; it < 600; it++) {
            memcpy(m, src, n);
            size_t len = n;
            int edits = 1 + (int)(kv_rng_next(&r) % 4);
            for (int e = 0; e < edits && len > 0; e++) {
                size_t pos = kv_rng_next(&r) % len;
                switch (kv_rng_next(&r) % 4) {
                case 0: m[pos] = (char)(kv_rng_next(&r) & 0xFF); break;                 /* flip */
                case 1: memmove(m + pos, m + pos + 1, len - pos - 1); len--; break;      /* delete */
                case 2: len = pos; break;                                                /* truncate */
                default: {                                                               /* duplicate */
                    size_t k = 1 + kv_rng_next(&r) % 16;
                    if (pos + k > len) k = len - pos;
                    if (len + k <= n + 63) {
                        memmove(m + pos + k, m + pos, len - pos);
                        len += k;
                    }
                }
                }
            }
            fuzz_one(m, len, ctx);
        }
        free(m);
        json_decref(cfg);
        used++;
    }
    json_decref(ctx);
    if (!used) skip();
}

/* tok_chat_render goes through the model's real template */
static void test_chat_render_template(void **s) {
    (void)s;
    char path[1024];
    if (!test_data_path(path, sizeof path, "tokenizers/qwen3/tokenizer.json")) skip();
    tokenizer_t *t;
    char err[256];
    assert_int_equal(tok_load(path, &t, err, sizeof err), KV_OK);
    json_t *msgs = json_pack("[{s:s,s:s}]", "role", "user", "content", "hi");
    json_t *kw = json_pack("{s:b}", "enable_thinking", 0);
    char *out;
    assert_int_equal(tok_chat_render_json(t, msgs, kw, true, &out, err, sizeof err), KV_OK);
    /* the template's enable_thinking=false branch: an empty think block opens the turn */
    const char *tail = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
    assert_true(strlen(out) >= strlen(tail) && !strcmp(out + strlen(out) - strlen(tail), tail));
    free(out);
    json_decref(kw);
    json_decref(msgs);
    tok_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_errors),       cmocka_unit_test(test_limits),
        cmocka_unit_test(test_fuzz_random),  cmocka_unit_test(test_fuzz_mutated),
        cmocka_unit_test(test_chat_render_template),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
