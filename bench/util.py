#!/usr/bin/env python3
"""Small helpers for bench/run.sh, profile.sh and ab.sh (Python 3 standard
library only).

    util.py ports N                       N free TCP ports on 127.0.0.1, one a line
    util.py h2load-json OUT LOG           an h2load run (its output OUT, its --log-file
                                          LOG) as wrk's BENCHJSON line
    util.py wait-http URL SECONDS [PID]   wait until URL answers 200 (exit 1 on timeout,
                                          or at once if process PID has died)
    util.py seed BASE PREFIX N TOKEN      PUT BASE/docs/<PREFIX><n> for n in [0, N) with
                                          X-Fence-Token: TOKEN; prints the status counts,
                                          exit 1 unless every answer is 2xx
    util.py rate WRK_OUT                  half of the wrk run's success throughput
                                          (2xx/s; 409/s for a run answered 409 only)
    util.py cost WRK_OUT FG PG [all] [XACTS]  answers/s of a wrk run of fenced.lua, and CPU
                                          µs per answer of fencegate and Postgres from
                                          their clock ticks FG and PG (2xx answers; every
                                          answer with `all`)
    util.py split WRK_OUT NAME BEFORE AFTER  req/s of a wrk run against a proxy, and per
                                          request: the proxy's CPU (all, user, system),
                                          the upstream's, the machine's, and the proxy's
                                          context switches (BEFORE/AFTER: see split())
    util.py metric URL NAME [MATCH]       sum of the Prometheus samples of NAME at URL
                                          (only those whose labels contain MATCH)
    util.py gate-open URL SECONDS FILE    wait (at most SECONDS) until the gateway whose
                                          /metrics is URL holds no key at its gate; when it
                                          held some, writes "KEYS WAITED_S" to FILE
    util.py vm PID                        VmRSS and VmHWM of PID in KiB: "RSS HWM"
    util.py pulse FILE                    until SIGTERM, how the machine kept time: the
                                          host's steal, and the longest gap between
                                          wake-ups 50 ms apart; written to FILE as JSON
    util.py pulse-line FILE               that FILE's steal % and lateness (ms), as two
                                          columns of a table
"""

import http.client
import json
import os
import re
import signal
import socket
import ssl
import sys
import threading
import time
import urllib.request


def ports(n):
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    for s in socks:
        print(s.getsockname()[1])
    for s in socks:
        s.close()


def alive(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return "Z" not in line.split()[1]
    except OSError:
        return False
    return True


def wait_http(url, seconds, pid=None):
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline:
        if pid is not None and not alive(pid):
            print(f"process {pid} exited while waiting for {url}", file=sys.stderr)
            return 1
        try:
            # https: the run's own throwaway certificate, checked by nobody.
            ctx = ssl._create_unverified_context() if url.startswith("https:") else None
            with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
                if r.status == 200:
                    return 0
        except Exception:
            pass
        time.sleep(0.1)
    print(f"{url} did not answer 200 within {seconds}s", file=sys.stderr)
    return 1


def seed(base, prefix, n, token):
    host_port = base.split("://", 1)[1].rstrip("/")
    host, port = host_port.rsplit(":", 1)
    n = int(n)
    nworkers = 64
    counts = {}
    lock = threading.Lock()

    def work(w):
        # Each request in one write, head and body together, as wrk and oha
        # send theirs. http.client writes the body separately, and with
        # Nagle's algorithm it follows the head only after a delayed ACK;
        # the benchmark's upstream (nginx `return 200`) answers on the head
        # alone, so such a write is an early answer, which keeps its key
        # closed for the route's timeout_ms (as it must), and the raising
        # scenario would then wait on the seeded keys.
        sock = socket.create_connection((host, int(port)), timeout=30)
        local = {}
        for i in range(w, n, nworkers):
            sock.sendall(
                f"PUT /docs/{prefix}{i} HTTP/1.1\r\nHost: {host_port}\r\n"
                f"X-Fence-Token: {token}\r\nContent-Length: 4\r\n\r\nseed".encode()
            )
            r = http.client.HTTPResponse(sock)
            r.begin()
            r.read()
            local[r.status] = local.get(r.status, 0) + 1
        sock.close()
        with lock:
            for k, v in local.items():
                counts[k] = counts.get(k, 0) + v

    t0 = time.monotonic()
    threads = [threading.Thread(target=work, args=(w,)) for w in range(nworkers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.monotonic() - t0
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    print(f"seeded {n} keys {prefix}0..{prefix}{n - 1} with token {token} in {dt:.1f}s ({summary})")
    ok = sum(v for k, v in counts.items() if 200 <= k < 300)
    return 0 if ok == n else 1


def parse_wrk(path):
    """The BENCHJSON line printed by bench/fenced.lua's done()."""
    with open(path) as f:
        for line in f:
            if line.startswith("BENCHJSON "):
                return json.loads(line[len("BENCHJSON "):])
    raise SystemExit(f"{path}: no BENCHJSON line (did wrk run?)")


def rate(path):
    w = parse_wrk(path)
    secs = w["duration_us"] / 1e6
    good = w["s2xx"] if w["s2xx"] else w["s409"]
    print(max(1, int(good / secs / 2)))


def cost(path, fg_ticks, pg_ticks, per="2xx", xacts=None):
    """A wrk run of bench/fenced.lua and the CPU it cost: answers per second
    and fencegate's and Postgres's microseconds per answer, counting 2xx
    answers (`per` "2xx") or every answer ("all": a run of 409s). With
    `xacts`, the transactions that wrote during the run: answers per
    transaction is the mean size of the store's batches."""
    w = parse_wrk(path)
    secs = w["duration_us"] / 1e6
    counted = w["s2xx"] if per == "2xx" else w["requests"]
    hz = os.sysconf("SC_CLK_TCK")
    fg = int(fg_ticks) / hz * 1e6 / max(counted, 1)
    pg = int(pg_ticks) / hz * 1e6 / max(counted, 1)
    other = w["requests"] - w["s2xx"]
    note = ""
    if per == "2xx" and other:
        note = f"  ({other} not 2xx: {w['s409']} 409, {w['sother']} other)"
    elif per != "2xx":
        note = "  (per answer)"
    # A column only for callers that count transactions (bench/ab.sh), whose
    # header has it.
    per_xact = ""
    if xacts is not None:
        n = int(xacts)
        per_xact = f" {counted / n:>8.1f}" if n > 0 else f" {'-':>8}"
    print(f"{counted / secs:>10,.0f} {fg:>12.1f} {pg:>12.1f}{per_xact}{note}")


def split(path, name, before, after):
    """A wrk run against a proxy and what it cost, by process: `before` and
    `after` are "user system voluntary involuntary" of the proxy
    (`proc_counts` in bench/lib.sh), then the upstream's ticks, then the
    machine's busy ticks. Prints req/s, then per request: the proxy's CPU
    (all, user, system), the upstream's, the machine's, and the proxy's
    voluntary and involuntary context switches."""
    # wrk's own summary (a plain GET, no script: the load generator's share
    # of the machine stays what it is in bench/run.sh's (b) and (c)).
    text = open(path).read()
    n = max(int(re.search(r"(\d+) requests in", text).group(1)), 1)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
    d = [int(a) - int(b) for a, b in zip(after.split(), before.split())]
    user, system, vol, inv, upstream, machine = d
    us = 1e6 / os.sysconf("SC_CLK_TCK") / n
    print(f"{name:<12} {rps:>9,.0f}"
          f" {(user + system) * us:>9.2f} {user * us:>6.2f} {system * us:>6.2f}"
          f" {upstream * us:>9.2f} {machine * us:>9.2f} {vol / n:>8.3f} {inv / n:>8.3f}")


def metric_sum(url, name, match=""):
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and match in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def metric(url, name, match=""):
    print(metric_sum(url, name, match))


def gate_open(url, seconds, path):
    """A load generator ends its run with requests in flight, and a fenced
    write whose client leaves mid-exchange keeps its key closed until the
    route's timeout_ms (the contract's rule: the gateway cannot know when the
    upstream is done with it). A write scenario that starts before then
    finds those keys closed: each of its requests to one waits at the gate,
    and a closed-loop client's connections pile up behind them. So the next
    scenario on the same gateway starts only once the gate is empty; how
    many keys were held and how long that took goes to `path` for the
    report."""
    t0 = time.monotonic()
    held = metric_sum(url, "fencegate_gate_keys")
    keys = held
    while keys > 0:
        if time.monotonic() - t0 > float(seconds):
            raise SystemExit(f"{keys} keys still held at the gate after {seconds} s")
        time.sleep(0.1)
        keys = metric_sum(url, "fencegate_gate_keys")
    if held > 0:
        with open(path, "w") as f:
            f.write(f"{held} {time.monotonic() - t0:.1f}\n")
    return 0


def vm(pid):
    rss = hwm = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    print(rss, hwm)


def cpu_ticks():
    """This machine's clock ticks since boot, summed over its CPUs, from
    /proc/stat's cpu line: (busy, steal). Busy is user, nice, system, irq
    and softirq (guest time is inside user); idle, iowait and the host's
    steal are not work done here."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
    return user + nice + system + irq + softirq, steal


PULSE = 0.05


def pulse(path):
    """Samples until SIGTERM, then writes what the machine went through.

    Two ways a shared machine stops everything measured at once: the host
    gives its CPUs to another guest (counted as steal), or the whole guest
    freezes (counted nowhere, but a process asleep for 50 ms wakes up
    seconds later). A run with either is not comparable to one without."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    start, (busy0, steal0) = time.monotonic(), cpu_ticks()
    last, longest = start, 0.0
    while not stop:
        time.sleep(PULSE)
        now = time.monotonic()
        longest = max(longest, now - last - PULSE)
        last = now
    seconds = time.monotonic() - start
    busy, steal = cpu_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    stolen = (steal - steal0) / hz
    with open(path, "w") as f:
        json.dump({"seconds": seconds,
                   "steal_pct": 100 * stolen / (seconds * (os.cpu_count() or 1)),
                   "longest_late_ms": 1000 * longest,
                   # All the work this machine did during the run, by every
                   # process and the kernel: the report's ceilings divide it
                   # by the run's answers.
                   "busy_s": (busy - busy0) / hz}, f)


def h2load_json(out_path, log_path):
    """h2load's summary and per-request log, in the fields fenced.lua's
    BENCHJSON line has, so that the report reads both tools alike."""
    with open(out_path) as f:
        text = f.read()
    m = re.search(r"finished in ([0-9.]+)(m?s)", text)
    secs = float(m.group(1)) / (1000 if m.group(2) == "ms" else 1) if m else 0.0
    req = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
                    r"(\d+) failed, (\d+) errored, (\d+) timeout", text)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", text)
    if not req or not codes:
        raise SystemExit(f"h2load output not understood:\n{text}")
    s2xx = int(codes.group(1))
    done = int(req.group(3))
    lat = []
    try:
        with open(log_path) as f:
            for line in f:
                parts = line.split("\t")
                if len(parts) >= 3:
                    lat.append(int(parts[2]))
    except OSError:
        pass
    lat.sort()
    pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0
    print("BENCHJSON " + json.dumps({
        "duration_us": int(secs * 1e6), "requests": done, "s2xx": s2xx, "s409": 0,
        "sother": done - s2xx, "err_connect": 0, "err_read": int(req.group(6)),
        "err_write": 0, "err_timeout": int(req.group(7)),
        "p50_us": pct(0.50), "p99_us": pct(0.99)}))


def pulse_line(path):
    with open(path) as f:
        p = json.load(f)
    print(f"{p['steal_pct']:>7.2f} {p['longest_late_ms']:>8.0f}")


def main(argv):
    cmd, args = argv[1], argv[2:]
    if cmd == "ports":
        ports(int(args[0]))
    elif cmd == "wait-http":
        return wait_http(args[0], args[1], int(args[2]) if len(args) > 2 else None)
    elif cmd == "seed":
        return seed(*args)
    elif cmd == "rate":
        rate(args[0])
    elif cmd == "cost":
        cost(*args)
    elif cmd == "split":
        split(*args)
    elif cmd == "metric":
        metric(*args)
    elif cmd == "gate-open":
        return gate_open(*args)
    elif cmd == "vm":
        vm(int(args[0]))
    elif cmd == "pulse":
        pulse(args[0])
    elif cmd == "pulse-line":
        pulse_line(args[0])
    elif cmd == "h2load-json":
        h2load_json(args[0], args[1])
    else:
        raise SystemExit(f"unknown command {cmd}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
