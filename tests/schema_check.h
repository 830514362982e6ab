/*
 * An independent JSON schema validator for the tests of the constrained decoder: it checks a
 * parsed instance against a schema with the plain JSON Schema rules (no grammar involved),
 * for the keywords the decoder supports (docs/structured-output.md). Strings are measured in
 * code points; "pattern" is searched with PCRE2 (ECMAScript-like semantics, UTF mode);
 * "format" is checked with PCRE2 patterns plus real calendar checks. Header-only, test use.
 */
#ifndef KV_TEST_SCHEMA_CHECK_H
#define KV_TEST_SCHEMA_CHECK_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <math.h>
#include <pcre2.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

/* 1 if the UTF-8 text subject matches re (search, or the whole text when full). -1: bad re. */
static inline int sc_pcre_match(const char *re, size_t re_len, const char *subj, size_t n, bool full) {
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *code = pcre2_compile((PCRE2_SPTR)re, re_len, PCRE2_UTF | PCRE2_ALT_BSUX | (full ? PCRE2_ANCHORED | PCRE2_ENDANCHORED : 0),
                                     &ec, &eo, NULL);
    if (!code) return -1;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(code, NULL);
    int rc = pcre2_match(code, (PCRE2_SPTR)subj, n, 0, 0, md, NULL);
    pcre2_match_data_free(md);
    pcre2_code_free(code);
    return rc >= 0 ? 1 : 0;
}

static inline size_t sc_utf8_len(const char *s, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80) c++;
    return c;
}

static bool sc_valid(const json_t *root, const json_t *s, const json_t *v, char *why, size_t cap);

static inline bool sc_type_is(const json_t *v, const char *t) {
    if (!strcmp(t, "object")) return json_is_object(v);
    if (!strcmp(t, "array")) return json_is_array(v);
    if (!strcmp(t, "string")) return json_is_string(v);
    if (!strcmp(t, "number")) return json_is_number(v);
    if (!strcmp(t, "integer"))
        return json_is_integer(v) || (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)));
    if (!strcmp(t, "boolean")) return json_is_boolean(v);
    if (!strcmp(t, "null")) return json_is_null(v);
    return false;
}

static inline const json_t *sc_resolve(const json_t *root, const char *ref) {
    if (!strcmp(ref, "#")) return root;
    if (strncmp(ref, "#/", 2)) return NULL;
    const json_t *cur = root;
    char buf[512];
    snprintf(buf, sizeof buf, "%s", ref + 2);
    for (char *tok = strtok(buf, "/"); tok && cur; tok = strtok(NULL, "/")) cur = json_object_get(cur, tok);
    return cur;
}

#define SC_FAIL(...) do { snprintf(why, cap, __VA_ARGS__); return false; } while (0)

static inline bool sc_days_ok(int y, int m, int d) {
    static const int md[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    if (m < 1 || m > 12 || d < 1) return false;
    int lim = md[m - 1] + (m == 2 && ((y % 4 == 0 && y % 100 != 0) || y % 400 == 0));
    return d <= lim;
}

static inline bool sc_format_ok(const char *f, const char *s, size_t n) {
#define SC_TIME "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]+)?(Z|z|[-+]([01][0-9]|2[0-3]):[0-5][0-9])"
    int y, m, d;
    if (!strcmp(f, "date"))
        return sc_pcre_match("[0-9]{4}-[0-9]{2}-[0-9]{2}", (size_t)-1, s, n, true) == 1 &&
               sscanf(s, "%d-%d-%d", &y, &m, &d) == 3 && sc_days_ok(y, m, d);
    if (!strcmp(f, "time")) return sc_pcre_match(SC_TIME, (size_t)-1, s, n, true) == 1;
    if (!strcmp(f, "date-time"))
        return sc_pcre_match("[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt]" SC_TIME, (size_t)-1, s, n, true) == 1 &&
               sscanf(s, "%d-%d-%d", &y, &m, &d) == 3 && sc_days_ok(y, m, d);
    if (!strcmp(f, "uuid"))
        return sc_pcre_match("[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}", (size_t)-1, s, n, true) == 1;
    if (!strcmp(f, "ipv4")) {
        int a[4];
        char tail;
        if (sc_pcre_match("[0-9]{1,3}(\\.[0-9]{1,3}){3}", (size_t)-1, s, n, true) != 1) return false;
        if (sscanf(s, "%d.%d.%d.%d%c", &a[0], &a[1], &a[2], &a[3], &tail) != 4) return false;
        for (int i = 0; i < 4; i++) if (a[i] > 255) return false;
        return sc_pcre_match("(^|\\.)0[0-9]", (size_t)-1, s, n, false) == 0; /* no leading zeros */
    }
    if (!strcmp(f, "email")) return memchr(s, '@', n) != NULL;
    return true;
#undef SC_TIME
}

static bool sc_valid(const json_t *root, const json_t *s, const json_t *v, char *why, size_t cap) {
    if (json_is_true(s)) return true;
    if (json_is_false(s)) SC_FAIL("false schema");
    const json_t *x;
    if ((x = json_object_get(s, "$ref"))) {
        const json_t *t = sc_resolve(root, json_string_value(x));
        if (!t) SC_FAIL("unresolvable ref");
        if (!sc_valid(root, t, v, why, cap)) return false;
    }
    if (json_is_true(json_object_get(s, "nullable")) && json_is_null(v)) return true;
    if ((x = json_object_get(s, "type"))) {
        bool ok = false;
        if (json_is_string(x)) ok = sc_type_is(v, json_string_value(x));
        else {
            size_t i;
            json_t *t;
            json_array_foreach(x, i, t) ok |= sc_type_is(v, json_string_value(t));
        }
        if (!ok) SC_FAIL("type");
    }
    if ((x = json_object_get(s, "enum"))) {
        bool ok = false;
        size_t i;
        json_t *e;
        json_array_foreach(x, i, e) ok |= json_equal(e, (json_t *)v);
        if (!ok) SC_FAIL("enum");
    }
    if ((x = json_object_get(s, "const")) && !json_equal(x, (json_t *)v)) SC_FAIL("const");
    if ((x = json_object_get(s, "anyOf"))) {
        bool ok = false;
        size_t i;
        json_t *e;
        json_array_foreach(x, i, e) ok |= sc_valid(root, e, v, why, cap);
        if (!ok) SC_FAIL("anyOf");
    }
    if ((x = json_object_get(s, "oneOf"))) {
        int n = 0;
        size_t i;
        json_t *e;
        json_array_foreach(x, i, e) n += sc_valid(root, e, v, why, cap);
        if (n != 1) SC_FAIL("oneOf matched %d", n);
    }
    if ((x = json_object_get(s, "allOf"))) {
        size_t i;
        json_t *e;
        json_array_foreach(x, i, e) if (!sc_valid(root, e, v, why, cap)) return false;
    }
    if (json_is_string(v)) {
        size_t n = json_string_length(v), cl = sc_utf8_len(json_string_value(v), n);
        if ((x = json_object_get(s, "minLength")) && cl < (size_t)json_integer_value(x)) SC_FAIL("minLength");
        if ((x = json_object_get(s, "maxLength")) && cl > (size_t)json_integer_value(x)) SC_FAIL("maxLength");
        if ((x = json_object_get(s, "pattern")) &&
            sc_pcre_match(json_string_value(x), json_string_length(x), json_string_value(v), n, false) != 1)
            SC_FAIL("pattern %s", json_string_value(x));
        if ((x = json_object_get(s, "format")) && !sc_format_ok(json_string_value(x), json_string_value(v), n))
            SC_FAIL("format %s", json_string_value(x));
    }
    if (json_is_number(v)) {
        double d = json_number_value(v);
        if ((x = json_object_get(s, "minimum")) && d < json_number_value(x)) SC_FAIL("minimum");
        if ((x = json_object_get(s, "maximum")) && d > json_number_value(x)) SC_FAIL("maximum");
        if ((x = json_object_get(s, "exclusiveMinimum")) && d <= json_number_value(x)) SC_FAIL("exclusiveMinimum");
        if ((x = json_object_get(s, "exclusiveMaximum")) && d >= json_number_value(x)) SC_FAIL("exclusiveMaximum");
    }
    if (json_is_array(v)) {
        size_t n = json_array_size(v);
        if ((x = json_object_get(s, "minItems")) && n < (size_t)json_integer_value(x)) SC_FAIL("minItems");
        if ((x = json_object_get(s, "maxItems")) && n > (size_t)json_integer_value(x)) SC_FAIL("maxItems");
        const json_t *pre = json_object_get(s, "prefixItems"), *items = json_object_get(s, "items");
        if (json_is_array(items)) { /* draft-07 tuple */
            pre = items;
            items = json_object_get(s, "additionalItems");
        }
        size_t np = pre ? json_array_size(pre) : 0;
        for (size_t i = 0; i < n; i++) {
            const json_t *is = i < np ? json_array_get(pre, i) : items;
            if (is && !sc_valid(root, is, json_array_get(v, i), why, cap)) return false;
        }
    }
    if (json_is_object(v)) {
        const json_t *props = json_object_get(s, "properties"), *add = json_object_get(s, "additionalProperties");
        size_t i;
        json_t *r;
        json_array_foreach(json_object_get(s, "required"), i, r)
            if (!json_object_get(v, json_string_value(r))) SC_FAIL("required %s", json_string_value(r));
        const char *k;
        json_t *mv;
        json_object_foreach((json_t *)v, k, mv) {
            const json_t *ps = props ? json_object_get(props, k) : NULL;
            if (ps) {
                if (!sc_valid(root, ps, mv, why, cap)) return false;
            } else if (add) {
                if (!sc_valid(root, add, mv, why, cap)) SC_FAIL("additionalProperties %s", k);
            }
        }
    }
    return true;
}
#undef SC_FAIL

/* Validates instance text (must parse as JSON: any value) against schema. */
static inline bool sc_check_text(const json_t *schema, const char *text, size_t n, char *why, size_t cap) {
    json_error_t je;
    json_t *v = json_loadb(text, n, JSON_DECODE_ANY, &je);
    if (!v) {
        snprintf(why, cap, "not JSON: %s", je.text);
        return false;
    }
    bool ok = sc_valid(schema, schema, v, why, cap);
    json_decref(v);
    return ok;
}

#endif
