# Shared by the e2e shell tests (source it): how a test says it cannot run.
#   skip_test MSG     something `make test` does not provide is missing (test data, a GPU,
#                     root): prints "SKIP: MSG" and exits 77, which ctest reports as skipped.
#   missing_dep MSG   a dependency that `make test` installs is missing (node, npm modules, jq,
#                     etcd, python3 ...): a skip as above, but a failure (exit 1) when
#                     KVSERVE_TESTS_REQUIRED=1 (set by ctest in a `make test` build), where it
#                     means the install step is broken.
#   need_cmd CMD...   missing_dep for each command not on PATH.
#   need_node_module NAME...  missing_dep for each package not in tests/e2e/node_modules (the
#                     e2e_npm_install test, a ctest fixture, installs them once before the
#                     tests that need them).
# And how it says it failed:
#   fail MSG          prints "FAIL: MSG" and exits 1.
#   expect_usage_error CMD...  CMD must exit 2 with a message on stderr (a usage error); its
#                     stdout and stderr are left in $usage_out and $usage_err.
skip_test() { echo "SKIP: $*"; exit 77; }
missing_dep() {
  if [[ "${KVSERVE_TESTS_REQUIRED:-0}" == 1 ]]; then
    echo "FAIL: $* (make test installs it: the test setup is broken)"; exit 1
  fi
  echo "SKIP: $*"; exit 77
}
need_cmd() { local c; for c in "$@"; do command -v "$c" >/dev/null 2>&1 || missing_dep "$c not installed"; done; }
need_node_module() {
  local d m; d="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/node_modules"
  for m in "$@"; do [[ -d "$d/$m" ]] || missing_dep "node module $m missing in $d (npm install in tests/e2e)"; done
}
fail() { echo "FAIL: $*"; exit 1; }
expect_usage_error() {
  local rc=0 e; e=$(mktemp)
  usage_out=$("$@" 2>"$e") || rc=$?
  usage_err=$(cat "$e"); rm -f "$e"
  [[ $rc == 2 ]] || fail "expected exit 2 from: $* (got $rc; $usage_err)"
  [[ -n $usage_err ]] || fail "no message from: $*"
}
