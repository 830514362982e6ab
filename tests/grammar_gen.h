/*
 * Random inputs for the constrained-decoding tests: a xorshift generator, random regexes
 * over a small alphabet (ASCII, 2- and 3-byte UTF-8, newline) and random JSON schemas from
 * the supported subset (bounded sizes so random walks end; oneOf branches of distinct types).
 * Header-only, test use.
 */
#ifndef KV_TEST_GRAMMAR_GEN_H
#define KV_TEST_GRAMMAR_GEN_H

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

struct rng { uint64_t s; };
static inline uint64_t rnext(struct rng *r) {
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return r->s;
}
static inline int rint_(struct rng *r, int n) { return (int)(rnext(r) % (uint64_t)n); }

/* out = x y z w (truncated to cap). */
static inline void cat4(char *out, size_t cap, const char *x, const char *y, const char *z, const char *w) {
    size_t o = 0;
    const char *parts[4] = {x, y, z, w};
    for (int i = 0; i < 4; i++)
        for (const char *p = parts[i]; *p && o + 1 < cap; p++) out[o++] = *p;
    out[o] = 0;
}

/* A random regex over the test alphabet. */
static inline void gen_regex(struct rng *r, int depth, char *out, size_t cap) {
    int k = depth <= 0 ? rint_(r, 4) : rint_(r, 9);
    char a[256], b[256];
    switch (k) {
    case 0: cat4(out, cap, (const char *[]){"a", "b", "c", "\xc3\xa9", "\u20ac", "-", "1", "\\n"}[rint_(r, 8)], "", "", ""); break;
    case 1: cat4(out, cap, (const char *[]){"[ab]", "[^a]", "[a-c]", "[\u00e9-\u20ac]", "\\d", "\\w", "\\s", "."}[rint_(r, 8)], "", "", ""); break;
    case 2: case 3: cat4(out, cap, (const char *[]){"a", "b", "(ab)", "c"}[rint_(r, 4)], "", "", ""); break;
    case 4: case 5:
        gen_regex(r, depth - 1, a, sizeof a);
        gen_regex(r, depth - 1, b, sizeof b);
        cat4(out, cap, a, b, "", "");
        break;
    case 6:
        gen_regex(r, depth - 1, a, sizeof a);
        gen_regex(r, depth - 1, b, sizeof b);
        cat4(out, cap, "(", a, "|", b);
        if (strlen(out) + 2 < cap) strcat(out, ")");
        break;
    default:
        gen_regex(r, depth - 1, a, sizeof a);
        cat4(out, cap, "(", a, ")", (const char *[]){"*", "+", "?", "{1,2}", "{2}", "{0,3}", "*?"}[rint_(r, 7)]);
        break;
    }
}

/* A random schema from the supported subset (distinct-typed oneOf branches, bounded sizes). */
static inline json_t *gen_schema(struct rng *r, int depth) {
    int k = rint_(r, depth > 0 ? 11 : 7);
    switch (k) {
    case 0: {
        json_t *s = json_pack("{s:s}", "type", "string");
        int mn = rint_(r, 3);
        json_object_set_new(s, "minLength", json_integer(mn));
        json_object_set_new(s, "maxLength", json_integer(mn + rint_(r, 5)));
        return s;
    }
    case 1: {
        json_t *s = json_pack("{s:s}", "type", "integer");
        int lo = rint_(r, 200) - 100;
        if (rint_(r, 2)) json_object_set_new(s, "minimum", json_integer(lo));
        if (rint_(r, 2)) json_object_set_new(s, "maximum", json_integer(lo + rint_(r, 300)));
        return s;
    }
    case 2: {
        json_t *s = json_pack("{s:s}", "type", "number");
        if (rint_(r, 2)) {
            int lo = rint_(r, 20) - 10;
            json_object_set_new(s, rint_(r, 2) ? "minimum" : "exclusiveMinimum", json_integer(lo));
            json_object_set_new(s, rint_(r, 2) ? "maximum" : "exclusiveMaximum", json_integer(lo + 1 + rint_(r, 20)));
        }
        return s;
    }
    case 3: return json_pack("{s:[s,s]}", "type", "boolean", "null");
    case 4: return json_pack("{s:[s,i,n,b]}", "enum", "a\"b", rint_(r, 50), 1);
    case 5: {
        static const char *const f[] = {"date", "time", "date-time", "uuid", "ipv4"};
        return json_pack("{s:s, s:s}", "type", "string", "format", f[rint_(r, 5)]);
    }
    case 6: {
        static const char *const p[] = {"^[A-Z][a-z]{0,4}$", "^(ab|cd)+$", "^\\d{3}-\\d{2}$", "x"};
        return json_pack("{s:s, s:s}", "type", "string", "pattern", p[rint_(r, 4)]);
    }
    case 7: case 8: {
        json_t *props = json_object(), *req = json_array();
        int n = 1 + rint_(r, 3);
        for (int i = 0; i < n; i++) {
            char name[16];
            snprintf(name, sizeof name, "k%d", i);
            json_object_set_new(props, name, gen_schema(r, depth - 1));
            if (rint_(r, 2)) json_array_append_new(req, json_string(name));
        }
        return json_pack("{s:s, s:o, s:o, s:b}", "type", "object", "properties", props, "required", req,
                         "additionalProperties", 0);
    }
    case 9: {
        json_t *s = json_pack("{s:s, s:o}", "type", "array", "items", gen_schema(r, depth - 1));
        int mn = rint_(r, 2);
        json_object_set_new(s, "minItems", json_integer(mn));
        json_object_set_new(s, "maxItems", json_integer(mn + rint_(r, 3)));
        return s;
    }
    default:
        return json_pack("{s:[{s:s},o]}", "anyOf", "type", "null", json_pack("{s:s, s:o}", "type", "array", "items",
                                                                                   gen_schema(r, depth - 1)));
    }
}

#endif
