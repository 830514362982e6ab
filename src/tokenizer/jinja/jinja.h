/*
 * jinja: a Jinja2 interpreter for the subset that chat templates use, written to render
 * byte-identically to Hugging Face's JavaScript engine (@huggingface/jinja 0.5.x, the one
 * transformers.js and the HF Hub use). See docs/chat-templates.md for the supported subset.
 *
 * Example:
 *   jinja_template_t *tpl; char err[256];
 *   if (jinja_parse(src, strlen(src), &tpl, err, sizeof err)) { puts(err); return; }
 *   json_t *ctx = json_pack("{s:[{s:s,s:s}],s:b}", "messages", "role", "user", "content", "hi",
 *                           "add_generation_prompt", 1);
 *   char *out; size_t n;
 *   if (jinja_render(tpl, ctx, &out, &n, err, sizeof err) == KV_OK) { fwrite(out, 1, n, stdout); free(out); }
 *   json_decref(ctx); jinja_free(tpl);
 *
 * Semantics follow the reference engine, quirks included: the template is preprocessed with
 * trim_blocks and lstrip_blocks, a single trailing newline is dropped, str.strip/lstrip/rstrip
 * ignore their argument and strip whitespace, booleans print as "true"/"false", `==` is
 * JavaScript loose equality, dicts keep insertion order.
 *
 * Errors: jinja_parse reports syntax errors and constructs outside the subset as
 * "line L, column C: <what>" (positions in the original template text, 1-based); jinja_render
 * reports runtime errors (raise_exception, type errors, unknown filters/tests) with the
 * position of the expression at fault. Nothing is left allocated after a failure. Limits
 * guard against runaway templates: 256 MiB of render memory, 64 MiB of output, 20 million
 * evaluation steps, nesting depth 256; exceeding one is an error, never a crash.
 *
 * Thread safety: a parsed template is immutable; any number of threads may render it at once.
 */
#ifndef KV_JINJA_H
#define KV_JINJA_H

#include <jansson.h>

#include "../../base/base.h"

typedef struct jinja_template jinja_template_t;

/* Parses src[0..len) (UTF-8). *out is owned by the caller (jinja_free). KV_EINVAL with a
 * message naming line/column on a syntax error or an unsupported construct; KV_ENOMEM. */
kv_status jinja_parse(const char *src, size_t len, jinja_template_t **out, char *err, size_t errlen);
void jinja_free(jinja_template_t *t);

/* Renders with the members of the JSON object ctx as global variables (ctx may be NULL).
 * JSON values map to template values: objects keep key order (integer-like keys first, as
 * in JavaScript), numbers with an integral value are integers. *out is heap-allocated and
 * NUL-terminated (caller frees), *out_len its length (out_len may be NULL). On failure
 * (KV_EINVAL: template error or raise_exception; KV_ENOMEM; KV_ETOOLONG: a limit) *out is
 * untouched and err holds the message. */
kv_status jinja_render(const jinja_template_t *t, const json_t *ctx, char **out, size_t *out_len, char *err,
                       size_t errlen);

#endif
