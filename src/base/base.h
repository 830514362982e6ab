/*
 * base: status codes, logging, small utilities shared by every subsystem.
 *
 * Error tiers (after ggml/llama.cpp):
 *   - kv_status for recoverable outcomes: 0 ok, negative = error, positive = soft
 *     outcome (e.g. KV_NO_SPACE: "no free block right now, try later").
 *   - allocation failure returns KV_ENOMEM and logs.
 *   - assert() only for broken invariants (bugs).
 * Functions that can fail take an optional `char *err, size_t errlen` buffer and fill
 * it with a human message naming the file/field/value at fault.
 */
#ifndef KV_BASE_H
#define KV_BASE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef int kv_status;

enum {
    KV_OK = 0,
    KV_EINVAL = -1,     /* invalid argument / parameter */
    KV_ENOMEM = -2,     /* allocation failed */
    KV_EIO = -3,        /* file or socket I/O failed */
    KV_EFORMAT = -4,    /* malformed or truncated file */
    KV_EUNSUPPORTED = -5, /* valid input we do not support (arch, dtype, construct) */
    KV_ENOTFOUND = -6,  /* missing file, key or tensor */
    KV_ETOOLONG = -7,   /* prompt/context longer than allowed */
    KV_EBUSY = -8,      /* queue full */
    KV_ECANCELLED = -9, /* request was cancelled */
    KV_EINTERNAL = -10, /* a bug or an impossible state */
    KV_NO_SPACE = 1,    /* soft: no free KV block right now */
};

/* Static string name of a status ("ok", "invalid argument", ...). Never NULL. */
const char *kv_status_str(kv_status s);

/* Formats into err (if err != NULL && errlen > 0); returns s so callers can
 * `return kv_errf(KV_EINVAL, err, errlen, "bad %s", x);`. */
kv_status kv_errf(kv_status s, char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* ---- logging (stderr, one line each, thread-safe) ---- */
typedef enum { KV_LOG_DEBUG = 0, KV_LOG_INFO, KV_LOG_WARN, KV_LOG_ERROR } kv_log_level;
void kv_log_set_level(kv_log_level lvl);
void kv_log(kv_log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define KV_DEBUG(...) kv_log(KV_LOG_DEBUG, __VA_ARGS__)
#define KV_INFO(...) kv_log(KV_LOG_INFO, __VA_ARGS__)
#define KV_WARN(...) kv_log(KV_LOG_WARN, __VA_ARGS__)
#define KV_ERROR(...) kv_log(KV_LOG_ERROR, __VA_ARGS__)

/* ---- time ---- */
/* Monotonic clock in nanoseconds / seconds (CLOCK_MONOTONIC). */
uint64_t kv_now_ns(void);
double kv_now_s(void);
/* Wall clock, seconds since the epoch (for OpenAI "created"). */
int64_t kv_unix_time(void);

/* ---- memory ---- */
/* malloc/calloc/realloc that log on failure and return NULL (never abort). */
void *kv_malloc(size_t n);
void *kv_calloc(size_t count, size_t size);
void *kv_realloc(void *p, size_t n);
char *kv_strdup(const char *s);
char *kv_strndup(const char *s, size_t n);
/* Fault injection (tests; SQLite's "fail the N-th allocation"): the n-th kv_malloc /
 * kv_calloc / kv_realloc (kv_strdup too) from now returns NULL, every other one succeeds;
 * n <= 0 disarms. kv_alloc_calls counts the kv_* allocations since the last call (any
 * thread; atomic), so a sweep knows when n went past the last one. */
void kv_alloc_fail_at(long n);
long kv_alloc_calls(void);

/* ---- files ---- */
/* Reads a whole file into a NUL-terminated heap buffer (caller frees).
 * Returns KV_ENOTFOUND / KV_EIO with a message naming the path. */
kv_status kv_read_file(const char *path, char **out, size_t *out_len, char *err, size_t errlen);
/* A read-only memory map of a whole file. On failure *out is untouched. */
typedef struct { void *data; size_t size; } kv_mmap_t;
kv_status kv_mmap_file(const char *path, kv_mmap_t *out, char *err, size_t errlen);
void kv_munmap(kv_mmap_t *m);
bool kv_path_is_dir(const char *path);
bool kv_path_exists(const char *path);
/* mkdir -p; 0 on success. */
kv_status kv_mkdirs(const char *path);

/* ---- parsing helpers for the CLI ---- */
/* Parses a byte size: "512MiB", "2GiB", "1G", "1000000", "64k" (k/M/G = 1024-based
 * as in llama.cpp/TRT-LLM configs; "KB/MB/GB" = 1000-based). KV_EINVAL on garbage,
 * negative or overflowing values. */
kv_status kv_parse_size(const char *s, uint64_t *out);
/* Strict integer parse (whole string, base 10, range-checked). */
kv_status kv_parse_i64(const char *s, int64_t min, int64_t max, int64_t *out);
/* True when s is "host:port": a non-empty host (an IPv6 address in brackets) and, after the
 * last ':', only decimal digits making a port 1-65535. Resolves nothing. */
bool kv_hostport_ok(const char *s);
/* Writes / reads exactly n bytes of a blocking descriptor (a pipe, a socket), retrying short
 * transfers and EINTR. 0 when all n bytes moved; -1 on an error or end of file (errno set,
 * or 0 at end of file), how many moved is then unknown. Thread-safe as the descriptor is. */
int kv_write_all(int fd, const void *p, size_t n);
int kv_read_all(int fd, void *p, size_t n);

/* A chunked bump allocator (the Jinja interpreter's and the grammar builder's node memory):
 * allocations live until kv_arena_free releases them all. Zero-initialise the struct (limit:
 * the most bytes of chunks it may hold, 0 = no limit). Not thread-safe. */
struct kv_arena_chunk;
struct kv_arena {
    struct kv_arena_chunk *head;
    size_t used;  /* bytes of chunks held */
    size_t limit; /* 0: none */
};
/* n bytes (at least 16), zeroed, 16-byte aligned; NULL when out of memory (*why = KV_ENOMEM)
 * or when a new chunk would pass the limit (*why = KV_ETOOLONG). The arena is unchanged then. */
void *kv_arena_alloc(struct kv_arena *a, size_t n, kv_status *why);
/* Frees every chunk; the arena is empty (limit kept) and reusable. */
void kv_arena_free(struct kv_arena *a);

/* ---- UTF-8 ---- */
/* Length in bytes of the UTF-8 sequence starting with lead byte c (1..4), 0 if c is
 * a continuation byte or invalid lead. */
int kv_utf8_seq_len(unsigned char c);
/* True if s[0..n) is entirely valid UTF-8 (no overlongs, no surrogates). */
bool kv_utf8_valid(const char *s, size_t n);
/* Number of bytes at the end of s[0..n) that form an incomplete (but so far valid)
 * UTF-8 sequence: 0..3. Used by streaming detokenizers to hold back partial chars. */
size_t kv_utf8_incomplete_tail(const char *s, size_t n);

/* ---- growable byte buffer ---- */
typedef struct {
    char *data; /* owned, NUL-terminated when len > 0 or after kv_buf_cstr */
    size_t len;
    size_t cap;
} kv_buf;
void kv_buf_init(kv_buf *b);
void kv_buf_free(kv_buf *b);
kv_status kv_buf_append(kv_buf *b, const void *p, size_t n);
kv_status kv_buf_puts(kv_buf *b, const char *s);
kv_status kv_buf_printf(kv_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *kv_buf_cstr(kv_buf *b); /* "" for an empty buffer */

/* ---- deterministic PRNG (xoshiro256**, seeded with splitmix64) ---- */
typedef struct { uint64_t s[4]; } kv_rng;
void kv_rng_seed(kv_rng *r, uint64_t seed);
uint64_t kv_rng_next(kv_rng *r);
/* Uniform in [0, 1) with 24 bits (float) / 53 bits (double). */
float kv_rng_f32(kv_rng *r);
double kv_rng_f64(kv_rng *r);

/* ---- half precision ---- */
float kv_f16_to_f32(uint16_t h);
uint16_t kv_f32_to_f16(float f);
float kv_bf16_to_f32(uint16_t h);

#endif
