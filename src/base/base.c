#include "base.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

const char *kv_status_str(kv_status s) {
    switch (s) {
    case KV_OK: return "ok";
    case KV_EINVAL: return "invalid argument";
    case KV_ENOMEM: return "out of memory";
    case KV_EIO: return "I/O error";
    case KV_EFORMAT: return "malformed file";
    case KV_EUNSUPPORTED: return "unsupported";
    case KV_ENOTFOUND: return "not found";
    case KV_ETOOLONG: return "too long";
    case KV_EBUSY: return "busy";
    case KV_ECANCELLED: return "cancelled";
    case KV_EINTERNAL: return "internal error";
    case KV_NO_SPACE: return "no space";
    default: return "unknown status";
    }
}

kv_status kv_errf(kv_status s, char *err, size_t errlen, const char *fmt, ...) {
    if (err && errlen > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return s;
}

static kv_log_level g_log_level = KV_LOG_INFO;
static pthread_mutex_t g_log_mu = PTHREAD_MUTEX_INITIALIZER;

void kv_log_set_level(kv_log_level lvl) { g_log_level = lvl; }

void kv_log(kv_log_level lvl, const char *fmt, ...) {
    if (lvl < g_log_level) return;
    static const char *names[] = {"debug", "info", "warn", "error"};
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    pthread_mutex_lock(&g_log_mu);
    fprintf(stderr, "%02d:%02d:%02d.%03ld %-5s ", tm.tm_hour, tm.tm_min, tm.tm_sec,
            ts.tv_nsec / 1000000, names[lvl]);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    pthread_mutex_unlock(&g_log_mu);
}

uint64_t kv_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
double kv_now_s(void) { return (double)kv_now_ns() / 1e9; }
int64_t kv_unix_time(void) { return (int64_t)time(NULL); }

/* Fault injection (kv_alloc_fail_at): the number of kv_* allocations left before the one
 * that fails; 0 = none armed. */
static _Atomic long g_alloc_countdown;
static _Atomic long g_alloc_calls;

void kv_alloc_fail_at(long n) {
    g_alloc_calls = 0;
    g_alloc_countdown = n > 0 ? n : 0;
}
long kv_alloc_calls(void) { return g_alloc_calls; }

/* True when this allocation is the one to fail. */
static bool alloc_injected(void) {
    g_alloc_calls++;
    if (g_alloc_countdown <= 0) return false;
    return --g_alloc_countdown == 0;
}

void *kv_malloc(size_t n) {
    void *p = alloc_injected() ? NULL : malloc(n ? n : 1);
    if (!p) KV_ERROR("out of memory allocating %zu bytes", n);
    return p;
}
void *kv_calloc(size_t count, size_t size) {
    void *p = alloc_injected() ? NULL : calloc(count ? count : 1, size ? size : 1);
    if (!p) KV_ERROR("out of memory allocating %zu x %zu bytes", count, size);
    return p;
}
void *kv_realloc(void *p, size_t n) {
    void *q = alloc_injected() ? NULL : realloc(p, n ? n : 1);
    if (!q) KV_ERROR("out of memory reallocating %zu bytes", n);
    return q;
}
char *kv_strdup(const char *s) { return kv_strndup(s, strlen(s)); }
char *kv_strndup(const char *s, size_t n) {
    char *p = kv_malloc(n + 1);
    if (!p) return NULL;
    memcpy(p, s, n);
    p[n] = 0;
    return p;
}

kv_status kv_read_file(const char *path, char **out, size_t *out_len, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return kv_errf(errno == ENOENT ? KV_ENOTFOUND : KV_EIO, err, errlen, "%s: %s", path,
                       strerror(errno));
    kv_buf b;
    kv_buf_init(&b);
    char tmp[65536];
    size_t n;
    while ((n = fread(tmp, 1, sizeof tmp, f)) > 0) {
        if (kv_buf_append(&b, tmp, n) != KV_OK) {
            fclose(f);
            kv_buf_free(&b);
            return kv_errf(KV_ENOMEM, err, errlen, "%s: out of memory", path);
        }
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        kv_buf_free(&b);
        return kv_errf(KV_EIO, err, errlen, "%s: read error", path);
    }
    kv_buf_cstr(&b);
    if (!b.data) b.data = kv_calloc(1, 1);
    *out = b.data;
    if (out_len) *out_len = b.len;
    return KV_OK;
}

kv_status kv_mmap_file(const char *path, kv_mmap_t *out, char *err, size_t errlen) {
    /* O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below) */
    int fd = open(path, O_RDONLY | O_NONBLOCK);
    if (fd < 0)
        return kv_errf(errno == ENOENT ? KV_ENOTFOUND : KV_EIO, err, errlen, "%s: %s", path,
                       strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return kv_errf(KV_EIO, err, errlen, "%s: not a regular file", path);
    }
    if (st.st_size == 0) {
        close(fd);
        return kv_errf(KV_EFORMAT, err, errlen, "%s: file is empty", path);
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return kv_errf(KV_EIO, err, errlen, "%s: mmap: %s", path, strerror(errno));
    out->data = p;
    out->size = (size_t)st.st_size;
    return KV_OK;
}

void kv_munmap(kv_mmap_t *m) {
    if (m && m->data) munmap(m->data, m->size);
    if (m) {
        m->data = NULL;
        m->size = 0;
    }
}

bool kv_path_is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}
bool kv_path_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}
kv_status kv_mkdirs(const char *path) {
    char tmp[4096];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof tmp) return KV_EINVAL;
    memcpy(tmp, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (tmp[i] == '/' || tmp[i] == 0) {
            char c = tmp[i];
            tmp[i] = 0;
            if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return KV_EIO;
            tmp[i] = c;
        }
    }
    return KV_OK;
}

kv_status kv_parse_size(const char *s, uint64_t *out) {
    if (!s || !*s) return KV_EINVAL;
    const char *p = s;
    while (*p == ' ') p++;
    if (*p < '0' || *p > '9') return KV_EINVAL;
    char *end;
    errno = 0;
    double v = strtod(p, &end);
    if (errno || v < 0) return KV_EINVAL;
    while (*end == ' ') end++;
    double mul = 1;
    char u[8] = {0};
    size_t ul = strlen(end);
    if (ul >= sizeof u) return KV_EINVAL;
    for (size_t i = 0; i < ul; i++) u[i] = (char)((end[i] >= 'a' && end[i] <= 'z') ? end[i] - 32 : end[i]);
    if (ul == 0 || !strcmp(u, "B")) mul = 1;
    else if (!strcmp(u, "K") || !strcmp(u, "KIB")) mul = 1024.0;
    else if (!strcmp(u, "M") || !strcmp(u, "MIB")) mul = 1024.0 * 1024;
    else if (!strcmp(u, "G") || !strcmp(u, "GIB")) mul = 1024.0 * 1024 * 1024;
    else if (!strcmp(u, "T") || !strcmp(u, "TIB")) mul = 1024.0 * 1024 * 1024 * 1024;
    else if (!strcmp(u, "KB")) mul = 1e3;
    else if (!strcmp(u, "MB")) mul = 1e6;
    else if (!strcmp(u, "GB")) mul = 1e9;
    else if (!strcmp(u, "TB")) mul = 1e12;
    else return KV_EINVAL;
    double r = v * mul;
    if (r >= 1.8e19) return KV_EINVAL;
    *out = (uint64_t)r;
    return KV_OK;
}

kv_status kv_parse_i64(const char *s, int64_t min, int64_t max, int64_t *out) {
    if (!s || !*s) return KV_EINVAL;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || end == s || v < min || v > max) return KV_EINVAL;
    *out = v;
    return KV_OK;
}

bool kv_hostport_ok(const char *s) {
    const char *c = s ? strrchr(s, ':') : NULL;
    if (!c || c == s) return false;
    for (const char *p = c + 1; *p; p++)
        if (*p < '0' || *p > '9') return false;
    int64_t port;
    return kv_parse_i64(c + 1, 1, 65535, &port) == KV_OK;
}

int kv_utf8_seq_len(unsigned char c) {
    if (c < 0x80) return 1;
    if (c < 0xC2) return 0;
    if (c < 0xE0) return 2;
    if (c < 0xF0) return 3;
    if (c < 0xF5) return 4;
    return 0;
}

/* Returns length of valid sequence at s (n bytes available), 0 if invalid,
 * -k if valid so far but truncated (k bytes present). */
static int utf8_check(const unsigned char *s, size_t n) {
    int len = kv_utf8_seq_len(s[0]);
    if (len == 0) return 0;
    if (len == 1) return 1;
    for (int i = 1; i < len; i++) {
        if ((size_t)i >= n) return -i;
        unsigned char c = s[i];
        if ((c & 0xC0) != 0x80) return 0;
        if (i == 1) {
            if (s[0] == 0xE0 && c < 0xA0) return 0;
            if (s[0] == 0xED && c > 0x9F) return 0;
            if (s[0] == 0xF0 && c < 0x90) return 0;
            if (s[0] == 0xF4 && c > 0x8F) return 0;
        }
    }
    return len;
}

bool kv_utf8_valid(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        int r = utf8_check(p + i, n - i);
        if (r <= 0) return false;
        i += (size_t)r;
    }
    return true;
}

size_t kv_utf8_incomplete_tail(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        unsigned char c = p[n - back];
        if ((c & 0xC0) == 0x80) continue;
        int r = utf8_check(p + n - back, back);
        return r < 0 ? back : 0;
    }
    return 0;
}

void kv_buf_init(kv_buf *b) {
    b->data = NULL;
    b->len = b->cap = 0;
}
void kv_buf_free(kv_buf *b) {
    free(b->data);
    kv_buf_init(b);
}
kv_status kv_buf_append(kv_buf *b, const void *p, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap * 2 : 64;
        while (nc < b->len + n + 1) nc *= 2;
        char *d = kv_realloc(b->data, nc);
        if (!d) return KV_ENOMEM;
        b->data = d;
        b->cap = nc;
    }
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
    return KV_OK;
}
kv_status kv_buf_puts(kv_buf *b, const char *s) { return kv_buf_append(b, s, strlen(s)); }
kv_status kv_buf_printf(kv_buf *b, const char *fmt, ...) {
    va_list ap, ap2;
    va_start(ap, fmt);
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
        va_end(ap2);
        return KV_EINVAL;
    }
    if (kv_buf_append(b, NULL, 0) != KV_OK || b->len + (size_t)n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 64;
        while (nc < b->len + (size_t)n + 1) nc *= 2;
        char *d = kv_realloc(b->data, nc);
        if (!d) {
            va_end(ap2);
            return KV_ENOMEM;
        }
        b->data = d;
        b->cap = nc;
    }
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap2);
    va_end(ap2);
    b->len += (size_t)n;
    return KV_OK;
}
const char *kv_buf_cstr(kv_buf *b) {
    if (!b->data) {
        if (kv_buf_append(b, NULL, 0) != KV_OK) return "";
    }
    return b->data;
}

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
void kv_rng_seed(kv_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}
static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
uint64_t kv_rng_next(kv_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}
float kv_rng_f32(kv_rng *r) { return (float)(kv_rng_next(r) >> 40) * (1.0f / 16777216.0f); }
double kv_rng_f64(kv_rng *r) { return (double)(kv_rng_next(r) >> 11) * (1.0 / 9007199254740992.0); }

float kv_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) {
                mant <<= 1;
                exp--;
            }
            mant &= 0x3ff;
            bits = sign | (exp << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t kv_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t mant = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        mant |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t half = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)exp << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) half++;
    return (uint16_t)half;
}

float kv_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

int kv_write_all(int fd, const void *p, size_t n) {
    for (size_t d = 0; d < n;) {
        ssize_t w = write(fd, (const char *)p + d, n - d);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        d += (size_t)w;
    }
    return 0;
}

int kv_read_all(int fd, void *p, size_t n) {
    for (size_t d = 0; d < n;) {
        ssize_t r = read(fd, (char *)p + d, n - d);
        if (r < 0 && errno == EINTR) continue;
        if (r == 0) errno = 0;
        if (r <= 0) return -1;
        d += (size_t)r;
    }
    return 0;
}

struct kv_arena_chunk {
    struct kv_arena_chunk *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
};

void *kv_arena_alloc(struct kv_arena *a, size_t n, kv_status *why) {
    n = n ? (n + 15) & ~(size_t)15 : 16;
    struct kv_arena_chunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        if (a->limit && a->used + cap > a->limit) {
            *why = KV_ETOOLONG;
            return NULL;
        }
        c = malloc(sizeof *c + cap);
        if (!c) {
            *why = KV_ENOMEM;
            return NULL;
        }
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
        a->used += cap;
    }
    void *p = c->data + c->used;
    c->used += n;
    memset(p, 0, n);
    return p;
}

void kv_arena_free(struct kv_arena *a) {
    for (struct kv_arena_chunk *c = a->head, *nx; c; c = nx) {
        nx = c->next;
        free(c);
    }
    a->head = NULL;
    a->used = 0;
}
