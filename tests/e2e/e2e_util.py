"""Helpers shared by the Python e2e scripts: bounded polls (never fixed sleeps)."""
import time


def wait_for(cond, limit=10.0, what="condition"):
    """Polls cond() every 20 ms until it returns a true value (returned) or limit seconds pass."""
    end = time.time() + limit
    while time.time() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError("timed out waiting for " + what)


def parse_metrics(text):
    """Prometheus text -> {"name{labels}": value} (comments and blank lines skipped)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, val = line.rsplit(" ", 1)
        out[name] = float(val)
    return out


def _tail(path, n=5):
    """The last n lines of a log file ("" when it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:]).rstrip()
    except (OSError, TypeError):
        return ""


def read_port(path, proc, limit=10.0, log_path=None):
    """The port a process wrote to its --port-file; fails early if the process exits (with the
    last lines of log_path, its output, when given)."""
    def ok():
        if proc.poll() is not None:
            tail = _tail(log_path) if log_path else ""
            raise AssertionError("process exited early: rc %s%s" % (proc.returncode, (":\n" + tail) if tail else ""))
        try:
            with open(path) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None
    return wait_for(ok, limit, "port file " + path)


def start_kvserve(bin_, args, log=None, env=None):
    """Starts `kvserve ARGS --port 0 --port-file TMP` (stdout/stderr to log, else to a file
    beside the port file); returns (process, port) once the port file is written. A process
    that exits first fails with the last lines of its output (its own error message)."""
    import os
    import subprocess
    import tempfile
    d = tempfile.mkdtemp(prefix="kvserve-")
    pf = os.path.join(d, "port")
    if log is None:
        log_path = os.path.join(d, "log")
        out = open(log_path, "wb")
    else:
        out, log_path = log, getattr(log, "name", None)
    p = subprocess.Popen([bin_, *args, "--port", "0", "--port-file", pf], stdout=out,
                         stderr=subprocess.STDOUT, env=env)
    if log is None:
        out.close()  # the child holds its own descriptor
    return p, read_port(pf, p, 120, log_path)


class Checks:
    """check(cond, what): counts a passed check or prints and keeps a failure."""

    def __init__(self):
        self.passed = 0
        self.failures = []

    def __call__(self, cond, what):
        if cond:
            self.passed += 1
        else:
            self.failures.append(what)
            print("FAIL:", what, flush=True)
