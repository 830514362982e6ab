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


def read_port(path, proc, limit=10.0):
    """The port a process wrote to its --port-file; fails early if the process exits."""
    def ok():
        if proc.poll() is not None:
            raise AssertionError("process exited early: rc %s" % proc.returncode)
        try:
            with open(path) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None
    return wait_for(ok, limit, "port file " + path)


def start_kvserve(bin_, args, log=None, env=None):
    """Starts `kvserve ARGS --port 0 --port-file TMP` (stdout/stderr to log, else discarded);
    returns (process, port) once the port file is written."""
    import os
    import subprocess
    import tempfile
    pf = os.path.join(tempfile.mkdtemp(prefix="kvserve-"), "port")
    out = log if log is not None else subprocess.DEVNULL
    p = subprocess.Popen([bin_, *args, "--port", "0", "--port-file", pf], stdout=out,
                         stderr=subprocess.STDOUT, env=env)
    return p, read_port(pf, p, 120)


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
