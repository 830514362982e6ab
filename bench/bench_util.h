/* bench_util: helpers shared by the bench/ programs (timing is base.h's kv_now_s). */
#ifndef KV_BENCH_UTIL_H
#define KV_BENCH_UTIL_H

/* qsort comparator for doubles, ascending (medians of timed runs). */
static inline int bench_cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

#endif
