/*
 * stop (engine-internal): stop-string matching over streamed text.
 *
 * Text arrives in deltas (already whole UTF-8 characters). The matcher emits only text
 * that can no longer be part of a stop string: it holds back the longest suffix that is a
 * proper prefix of some stop string. When a stop string appears (possibly spanning many
 * deltas) everything before its earliest occurrence is emitted and the rest is dropped;
 * the stop string itself never leaks.
 *
 *   deltas:  "Hel" "lo\nUs" "er:"       stop = "\nUser:"
 *   emitted: "Hel" "lo"     ""  -> stop (held "\nUs" then "\nUser:" matched, dropped)
 *
 * Pure functions over owned buffers; no tokenizer needed.
 */
#ifndef KV_ENGINE_STOP_H
#define KV_ENGINE_STOP_H

#include "../base/base.h"

struct stop_matcher {
    char **stops;     /* (n_stops) owned NUL-terminated copies; empty strings are dropped */
    size_t *lens;     /* (n_stops) */
    int n_stops;
    kv_buf held;      /* text received but not yet emitted */
    bool stopped;     /* a stop string was found; further input is ignored */
};

/* Copies stops[0..n). KV_ENOMEM (matcher left empty and freeable) on failure. */
kv_status stop_init(struct stop_matcher *m, const char *const *stops, int n);
void stop_free(struct stop_matcher *m);

/* Feeds text[0..len): appends the newly safe text to out. Returns true when a stop string
 * was found (now or earlier); out then ends right before it. KV_ENOMEM is reported as a
 * negative return through *st if st != NULL (out may hold partial text). */
bool stop_feed(struct stop_matcher *m, const char *text, size_t len, kv_buf *out, kv_status *st);
/* End of stream without a stop: appends the held-back text to out (nothing if stopped). */
kv_status stop_flush(struct stop_matcher *m, kv_buf *out);

#endif
