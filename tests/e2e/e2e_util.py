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
