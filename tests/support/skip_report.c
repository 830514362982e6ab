/*
 * skip_report: makes a cmocka test binary that skipped tests report as skipped to ctest.
 *
 * Every unit test is linked with this file and -Wl,--wrap=_skip,--wrap=_cmocka_run_group_tests
 * (CMakeLists.txt): cmocka's skip() macro calls _skip(), which is counted here; the group
 * runner's failure counts are summed. At exit, a binary with no failed test and at least one
 * skipped test leaves with status 77, which ctest reports as "Skipped" (SKIP_RETURN_CODE 77)
 * instead of "Passed". A binary with a failure keeps its failing status; one that ran every
 * test keeps status 0. The test sources need no change.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmocka.h>

static int g_skipped, g_failed, g_registered;

void __real__skip(const char *const file, const int line);
int __real__cmocka_run_group_tests(const char *group_name, const struct CMUnitTest *const tests,
                                   const size_t num_tests, CMFixtureFunction group_setup,
                                   CMFixtureFunction group_teardown);

static void report_at_exit(void) {
    if (g_failed == 0 && g_skipped > 0) {
        fprintf(stderr, "SKIP: %d test(s) skipped (see the SKIP lines above); reported as skipped\n",
                g_skipped);
        fflush(stdout);
        fflush(stderr);
        _exit(77);
    }
}

void __wrap__skip(const char *const file, const int line) {
    g_skipped++;
    __real__skip(file, line);
}

int __wrap__cmocka_run_group_tests(const char *group_name, const struct CMUnitTest *const tests,
                                   const size_t num_tests, CMFixtureFunction group_setup,
                                   CMFixtureFunction group_teardown) {
    if (!g_registered) {
        g_registered = 1;
        atexit(report_at_exit);
    }
    int rc = __real__cmocka_run_group_tests(group_name, tests, num_tests, group_setup,
                                            group_teardown);
    g_failed += rc;
    return rc;
}
