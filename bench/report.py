#!/usr/bin/env python3
"""Turn the raw outputs of bench/run.sh into a table, ratios and BENCHMARKS.md.

    report.py --out DIR [meta options] [--json FILE] [--markdown FILE] [--svg-link PATH]

Reads DIR/wrk_*.txt (the BENCHJSON line of bench/fenced.lua), DIR/pace_*.json
(bench/pace's open-loop runs), DIR/pgbench_g.txt and the memory files (with
DIR/oha_mem.json); prints the table and the ratios to
stdout; writes the results as JSON (for bench/chart.py) and the markdown
report when asked. Never fails because a target is missed. Standard library only.
"""

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys

SCENARIOS = [
    # id, name, system, wrk mode, what req/s counts
    ("a", "upstream direct GET (nginx)", "nginx", "get"),
    ("b", "nginx proxy GET", "nginx", "get"),
    ("c", "fencegate pass-through GET", "fencegate", "get"),
    ("d", "fenced PUT, current token", "fencegate", "reuse"),
    ("e", "fenced PUT, raising token", "fencegate", "raise"),
    ("f", "stale PUT answered 409", "fencegate", "stale"),
    ("g", "pgbench conditional upsert", "pgbench", None),
    ("h", "keyed POST, fresh Idempotency-Key", "fencegate", "fresh"),
    ("i", "keyed POST replayed", "fencegate", "replay"),
    ("j", "shared mode: fenced PUT, raising token", "fencegate", "raise"),
    ("k", "nginx TLS proxy GET", "nginx", "get"),
    ("l", "fencegate TLS pass-through GET", "fencegate", "get"),
    ("m", "nginx HTTP/2 (h2c) proxy GET", "nginx", "get"),
    ("n", "fencegate HTTP/2 (h2c) pass-through GET", "fencegate", "get"),
    ("o", "fenced PUT, raising token, HTTP/1.1", "fencegate", "raise"),
    ("p", "fenced PUT, raising token, HTTP/2 (h2c)", "fencegate", "raise"),
    ("q", "gRPC unary write, direct to grpcio", "grpcio", "get"),
    ("r", "gRPC unary write through fencegate (fenced)", "fencegate", "get"),
]

# Scenarios measured with h2load (many streams on few connections), not wrk.
H2LOAD = {"m", "n", "q", "r"}

TARGETS = [
    # name, numerator, denominator, minimum, what it means
    ("c/b", "c", "b", 1.0, "pass-through GET vs nginx proxy"),
    ("d/c", "d", "c", 0.9, "fenced PUT (current token) vs pass-through GET"),
    ("e/g", "e", "g", 3.0, "raising PUTs (2xx/s) vs pgbench upsert tps"),
    ("f/c", "f", "c", 1.5, "stale PUT (409) vs pass-through GET"),
    ("h/g", "h", "g", 1.0, "first uses of fresh Idempotency-Keys vs pgbench upsert tps"),
    ("i/c", "i", "c", 0.8, "Idempotency-Key replays vs pass-through GET"),
    ("j/g", "j", "g", 1.0, "shared-mode raising PUTs (2xx/s) vs pgbench upsert tps"),
    ("l/k", "l", "k", 1.0, "TLS pass-through GET vs nginx terminating TLS and proxying"),
    ("n/m", "n", "m", 1.0, "HTTP/2 pass-through GET vs nginx's http2 proxy, 32 streams on each of 4 connections"),
    ("p/o", "p", "o", 0.9, "raising PUTs over h2c (4 connections, 16 streams each) vs over HTTP/1.1 (64 connections), one client"),
    ("r/q", "r", "q", 0.8, "gRPC unary writes through the gateway (fenced) vs direct to the gRPC server"),
]

# Upper bounds on latency ratios: p99 of one scenario's open-loop run over
# another's, both open loop at the same rate.
LATENCY_TARGETS = [
    # name, numerator, denominator, maximum, what it means
    ("p99 c/b", "c", "b", 1.2, "pass-through GET p99 vs nginx proxy p99, both at (c)'s open-loop rate"),
]

# The ratios against (g) whose numerator waits on Postgres's commits: for
# each, the report gives a ceiling, the ratio this machine would allow if
# everything fencegate does for such a write beyond passing a GET through
# cost nothing (see `ceilings`).
CEILINGS = ["e/g", "h/g", "j/g"]

# What the gateway counted in fencegate_idempotency_total during (h) and (i)
# (and the probes before them), by outcome.
IDEM_OUTCOMES = ["first", "replayed", "in_progress", "reused", "outcome_unknown", "not_stored"]
RSS_TARGET_MIB = 128


def read(path, default=None):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def wrk(out, sid):
    text = read(os.path.join(out, f"wrk_{sid}.txt"))
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("BENCHJSON "):
            return json.loads(line[len("BENCHJSON "):])
    return None


def tool_json(out, tool, sid):
    """One JSON answer of a load tool for one run: `pace` (bench/pace's
    open-loop runs, see its crate docs) or `oha` (the memory check)."""
    text = read(os.path.join(out, f"{tool}_{sid}.json"))
    if not text:
        return None
    return json.loads(text)


def pgbench(out, sid="g"):
    text = read(os.path.join(out, f"pgbench_{sid}.txt"), "")
    res = {}
    m = re.search(r"^tps = ([0-9.]+)", text, re.M)
    if m:
        res["tps"] = float(m.group(1))
    m = re.search(r"number of transactions actually processed: (\d+)", text)
    if m:
        res["transactions"] = int(m.group(1))
    m = re.search(r"number of failed transactions: (\d+)", text)
    if m:
        res["failed"] = int(m.group(1))
    m = re.search(r"latency average = ([0-9.]+) ms", text)
    if m:
        res["latency_avg_ms"] = float(m.group(1))
    return res


def machine():
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_kib = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_kib = int(line.split()[1])
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "kernel": platform.release(),
    }


# A measured run is flagged as disturbed when the host took at least this
# share of the machine's CPU time during it (steal), or when a process
# asleep for 50 ms woke up at least this late (the whole machine froze, or
# got no CPU): see util.py pulse.
STEAL_FLAG_PCT = 1.0
LATE_FLAG_MS = 250


def pulses(out):
    """What util.py pulse saw during each measured run, by run: wrk and
    pgbench runs by scenario id (a repeat as `e_r2`), open-loop runs as `pace_c`."""
    found = {}
    for name in sorted(os.listdir(out)):
        m = re.fullmatch(r"pulse_(.+)\.json", name)
        if not m:
            continue
        try:
            p = json.loads(read(os.path.join(out, name), ""))
        except ValueError:
            continue
        p["disturbed"] = (p["steal_pct"] >= STEAL_FLAG_PCT
                          or p["longest_late_ms"] >= LATE_FLAG_MS)
        found[m.group(1)] = p
    return found


def held(out):
    """The keys held at the gate before each run, and how long the run
    waited for them (see util.py gate_open), by run."""
    found = {}
    for name in sorted(os.listdir(out)):
        m = re.fullmatch(r"held_(.+)\.txt", name)
        parts = (read(os.path.join(out, name), "") or "").split() if m else []
        if len(parts) == 2:
            found[m.group(1)] = (int(parts[0]), parts[1])
    return found


def disturbance(run, p):
    return (f"run {run} DISTURBED: host steal {p['steal_pct']:.1f}% of the CPU time, "
            f"a 50 ms sleep woke {p['longest_late_ms']:,.0f} ms late")


def mean_with(s, again, how, tail=""):
    """Makes scenario `s`'s rate the mean of its run and `again` (a second
    run's rate, if there was one), and says so in its notes."""
    if s["rps"] is None or again is None:
        return
    runs = [s["rps"], again]
    s["rps"] = sum(runs) / len(runs)
    s["runs"] = runs
    s["notes"].append(f"mean of 2 {how}: " + ", ".join(f"{r:,.0f}" for r in runs) + tail)


def combined_with(s, again, how):
    """Makes scenario `s`'s rate that of its run and its repeats' rates
    `again` together: the mean of two runs, the median of three or more
    (one run slowed by a stall of the machine does not move a median),
    and says so in its notes."""
    if s["rps"] is None or not again:
        return
    if len(again) == 1:
        mean_with(s, again[0], how)
        return
    runs = [s["rps"], *again]
    s["rps"] = statistics.median(runs)
    s["runs"] = runs
    s["notes"].append(f"median of {len(runs)} {how}: " + ", ".join(f"{r:,.0f}" for r in runs))


def run_cost(out, run, w, answers):
    """What one wrk run `w` cost per answer, in microseconds of CPU: the
    whole machine's (every process and the kernel, from util.py pulse) and
    Postgres's server processes' (pulse_stop in bench/run.sh, whose
    snapshots bracket the whole run). The pulse starts a little after wrk
    (a Python process starting), so the machine's busy time is taken per
    second of the pulse, over wrk's duration. None where a file is missing,
    or there were no answers."""
    try:
        p = json.loads(read(os.path.join(out, f"pulse_{run}.json"), ""))
        pg_ticks = int(read(os.path.join(out, f"pg_ticks_{run}.txt"), ""))
    except (TypeError, ValueError):
        return None
    if "busy_s" not in p or not answers or not p["seconds"]:
        return None
    busy_s = p["busy_s"] / p["seconds"] * (w["duration_us"] / 1e6)
    return {"machine_us": busy_s * 1e6 / answers,
            "pg_us": pg_ticks / os.sysconf("SC_CLK_TCK") * 1e6 / answers}


def ceilings(out, by_id, ratios, nproc):
    """For each ratio of CEILINGS, X/g: the most (X) could reach on this
    machine if fencegate's own work for it beyond passing a GET through
    were free, as a ratio to (g). Each (X) answer needs at least what a GET
    passed through needs of the whole machine (wrk, nginx, fencegate, the
    kernel: the cheapest of (c)'s runs), plus what Postgres's server
    processes spent per (X) answer (its cheapest run). Not counted, so the
    ceiling stays above what can be reached: the kernel's work writing and
    flushing the WAL, a PUT's body, the gate, the hand-off to the store.
    None without the costs (Postgres on another machine: its CPU is not
    seen here)."""
    def cheapest(sid, key, count):
        costs = []
        for run in (sid, f"{sid}_r2", f"{sid}_r3"):
            w = wrk(out, run)
            c = run_cost(out, run, w, count(w)) if w else None
            if c:
                costs.append(c[key])
        return min(costs) if costs else None

    get_us = cheapest("c", "machine_us", lambda w: w["requests"])
    found = []
    for r in ratios:
        if r["name"] not in CEILINGS:
            continue
        num = r["name"].split("/")[0]
        pg_us = cheapest(num, "pg_us", lambda w: w["s2xx"])
        g = by_id["g"]["rps"]
        ceiling = None
        if get_us and pg_us and g:
            ceiling = nproc * 1e6 / (get_us + pg_us) / g
        found.append({"name": r["name"], "target": r["target"], "value": r["value"],
                      "ceiling": ceiling, "get_machine_us": get_us, "pg_us": pg_us})
    return found


def build(a):
    out = a.out
    scen = []
    for sid, name, system, mode in SCENARIOS:
        s = {"id": sid, "name": name, "system": system, "rps": None, "p50_ms": None,
             "p99_ms": None, "notes": [], "unit": "req/s"}
        if sid == "g":
            pg = pgbench(out)
            s["pgbench"] = pg
            s["rps"] = pg.get("tps")
            mean_with(s, pgbench(out, "g_r2").get("tps"), "runs alternated with (e)'s")
            s["unit"] = "tps"
            s["tool"] = f"pgbench -c {a.conns} -j {a.threads} -T {a.duration} -n"
            if "failed" in pg and pg["failed"]:
                s["notes"].append(f"{pg['failed']} failed transactions")
            if "latency_avg_ms" in pg:
                s["notes"].append(f"closed-loop latency average {pg['latency_avg_ms']:.2f} ms")
            scen.append(s)
            continue
        w = wrk(out, sid)
        s["wrk"] = w
        if sid in {"q", "r"}:
            s["tool"] = f"h2load -c4 -m16 -t{a.threads} -D{a.duration} (gRPC)"
        elif sid in H2LOAD:
            s["tool"] = f"h2load -c4 -m32 -t{a.threads} -D{a.duration}"
        elif sid == "o":
            s["tool"] = f"volley --protocol h1 --connections 64 --seconds {a.duration}"
        elif sid == "p":
            s["tool"] = f"volley --protocol h2c --connections 4 --streams 16 --seconds {a.duration}"
        else:
            s["tool"] = f"wrk -t{a.threads} -c{a.conns} -d{a.duration}s"
        if w:
            secs = w["duration_us"] / 1e6
            total = w["requests"]
            if mode == "raise":
                s["rps"] = w["s2xx"] / secs
                answered = w["s2xx"] + w["s409"] + w["sother"]
                share = (w["s409"] / answered) if answered else 0.0
                s["share_409"] = share
                s["notes"].append(f"2xx/s; 409 share {share * 100:.2f}% "
                                  f"({w['s409']} of {answered})")
                again = wrk(out, f"{sid}_r2")
                if again:
                    how = ("alternated runs, each on keys new to the store" if sid in {"o", "p"}
                           else "runs alternated with (g)'s, the second on a fresh gateway "
                           "and database")
                    mean_with(s, again["s2xx"] / (again["duration_us"] / 1e6), how,
                              f" (409s in the second: {again['s409']})")
            else:
                s["rps"] = total / secs
                repeats = [r for r in (wrk(out, f"{sid}_r{n}") for n in (2, 3)) if r]
                combined_with(s, [r["requests"] / (r["duration_us"] / 1e6) for r in repeats],
                              "alternated runs")
            expect = "s409" if mode == "stale" else "s2xx"
            unexpected = w["s2xx"] + w["s409"] + w["sother"] - w[expect]
            if mode == "raise":
                unexpected = w["sother"]
            if unexpected:
                s["notes"].append(f"UNEXPECTED: {unexpected} answers other than "
                                  f"{'409' if mode == 'stale' else '2xx'}"
                                  + (f" ({w['sother']} neither 2xx nor 409)" if w["sother"] else ""))
            errs = sum(w[k] for k in ("err_connect", "err_read", "err_write", "err_timeout"))
            if errs:
                s["notes"].append(f"socket errors: connect {w['err_connect']}, read {w['err_read']}, "
                                  f"write {w['err_write']}, timeout {w['err_timeout']}")
            s["wrk_p50_ms"] = w["p50_us"] / 1000
            s["wrk_p99_ms"] = w["p99_us"] / 1000
        o = tool_json(out, "pace", sid)
        if o:
            s["open_rate"] = int(read(os.path.join(out, f"rate_{sid}.txt"), "0"))
            s["p50_ms"] = o["p50_ms"]
            s["p99_ms"] = o["p99_ms"]
            # Alternated repeats of the same open-loop run (full runs,
            # (b) and (c)): each percentile is the median of the runs.
            runs = [o] + [r for r in (tool_json(out, "pace", f"{sid}_r{n}") for n in (2, 3)) if r]
            if len(runs) > 1:
                p99s = [r["p99_ms"] for r in runs]
                s["p50_ms"] = statistics.median(r["p50_ms"] for r in runs)
                s["p99_ms"] = statistics.median(p99s)
                s["p99_runs"] = p99s
                s["notes"].append(f"p50/p99: median of {len(runs)} alternated open-loop runs, p99 "
                                  + ", ".join(f"{v:.2f}" for v in p99s) + " ms")
            s["open_status"] = o.get("statuses", {})
            s["open_errors"] = o.get("error_kinds", {})
            s["open_url"] = read(os.path.join(out, f"paceurl_{sid}.txt"), "")
            codes = ", ".join(f"{k}: {v}" for k, v in sorted(s["open_status"].items()))
            s["notes"].append(f"pace at {s['open_rate']}/s (achieved {o['rate']:,.0f}/s), "
                              f"{s['open_url']}; {codes}")
            if s["open_errors"]:
                s["notes"].append(f"pace errors: {s['open_errors']}")
        scen.append(s)

    by_id = {s["id"]: s for s in scen}
    machine_pulses = pulses(out)
    for run, p in machine_pulses.items():
        sid = re.sub(r"^pace_", "", run).split("_r")[0]
        if p["disturbed"] and sid in by_id:
            by_id[sid]["notes"].append(disturbance(run, p))
    for run, (keys, waited) in held(out).items():
        sid = re.sub(r"^pace_", "", run).split("_r")[0]
        if sid in by_id:
            by_id[sid]["notes"].append(
                f"before run {run}: {keys} keys held by the previous run's last writes "
                f"(its client left mid-exchange), waited out ({waited} s)")
    idem = {}
    for outcome in IDEM_OUTCOMES:
        v = read(os.path.join(out, f"fg_idem_{outcome}.txt"))
        if v is not None and v.isdigit():
            idem[outcome] = int(v)
    if idem:
        counted = ", ".join(f"{k} {v:,}" for k, v in idem.items() if v)
        for sid in ("h", "i"):
            by_id[sid]["notes"].append(f"gateway's Idempotency-Key outcomes over (h) and (i): {counted}")
    latency = []
    for name, num, den, maximum, meaning in LATENCY_TARGETS:
        n, d = by_id[num]["p99_ms"], by_id[den]["p99_ms"]
        value = (n / d) if (n is not None and d) else None
        latency.append({"name": name, "value": value, "target": maximum, "meaning": meaning,
                        "met": (value is not None and value <= maximum)})
    ratios = []
    for name, num, den, minimum, meaning in TARGETS:
        n, d = by_id[num]["rps"], by_id[den]["rps"]
        value = (n / d) if (n is not None and d) else None
        ratios.append({"name": name, "value": value, "target": minimum, "meaning": meaning,
                       "met": (value is not None and value >= minimum)})

    limits = ceilings(out, by_id, ratios, os.cpu_count() or 1)

    before = read(os.path.join(out, "mem_before.txt"), "0 0").split()
    after = read(os.path.join(out, "mem_after.txt"), "0 0").split()
    om = tool_json(out, "oha", "mem") or {}
    mem = {
        "keys_requested": a.mem_keys,
        "forwarded": int(read(os.path.join(out, "mem_decisions.txt"), "0") or 0),
        "rss_start_mib": int(before[0]) / 1024,
        "rss_mib": int(after[0]) / 1024,
        "hwm_mib": int(after[1]) / 1024,
        "status": om.get("statusCodeDistribution", {}),
        "errors": om.get("errorDistribution", {}),
        "rps": om.get("summary", {}).get("requestsPerSec"),
        "method": read(os.path.join(out, "mem_method.txt"), ""),
        "store": read(os.path.join(out, "mem_store.txt"), "SQLite"),
    }
    mem["met"] = mem["rss_mib"] <= RSS_TARGET_MIB and mem["rss_mib"] > 0

    now = datetime.datetime.now(datetime.timezone.utc).astimezone()
    meta = {
        "date": now.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine(),
        "commit": a.commit,
        "profile": a.profile,
        "dirty": int(a.dirty),
        "command": a.command,
        "mode": a.mode,
        "duration_s": a.duration,
        "threads": a.threads,
        "conns": a.conns,
        "nkeys": a.nkeys,
        "versions": {"wrk": a.wrk_version, "oha": a.oha_version, "nginx": a.nginx_version,
                     "pgbench": a.pgbench_version, "postgres": a.pg_version},
        "store_unavailable": int(read(os.path.join(out, "fg_503.txt"), "0") or 0),
        "idempotency": idem,
        "loadavg_start": read(os.path.join(out, "loadavg_start.txt"), "?"),
        "pulses": machine_pulses,
        "autogroup": read(os.path.join(out, "autogroup.txt"), "not recorded"),
    }
    meta["subtitle"] = (f"{meta['machine']['nproc']} cores, {meta['machine']['cpu']}; commit "
                        f"{a.commit}{' (+local changes)' if meta['dirty'] else ''}; "
                        f"{a.mode} run, {a.duration} s per scenario, {a.conns} connections")
    meta["store_unavailable_j"] = int(read(os.path.join(out, "fg_503_j.txt"), "0") or 0)
    return {"meta": meta, "scenarios": scen, "ratios": ratios, "latency": latency, "memory": mem,
            "ceilings": limits}


def f0(v):
    return "n/a" if v is None else f"{v:,.0f}"


def fms(v):
    return "-" if v is None else f"{v:.2f} ms"


def table_lines(res):
    lines = ["| scenario | req/s | p50 | p99 | notes |", "| --- | ---: | ---: | ---: | --- |"]
    for s in res["scenarios"]:
        rps = f0(s["rps"]) + (" tps" if s["unit"] == "tps" else "")
        lines.append(f"| ({s['id']}) {s['name']} | {rps} | {fms(s['p50_ms'])} | {fms(s['p99_ms'])} "
                     f"| {'; '.join(s['notes'])} |")
    return lines


def target_rows(res):
    """The ratios (each to reach its target) and then the latencies (each to
    stay within it), as (row, value shown, bound, result): the markdown and
    the terminal tables list the same rows."""
    for rows, bound in ((res["ratios"], ">="), (res.get("latency", []), "<=")):
        for r in rows:
            v = "n/a" if r["value"] is None else f"{r['value']:.2f}"
            yield r, v, bound, "met" if r["met"] else "NOT met"


def ratio_lines(res):
    lines = ["| ratio | value | target | | meaning |", "| --- | ---: | ---: | --- | --- |"]
    for r, v, bound, result in target_rows(res):
        sign = {">=": "≥", "<=": "≤"}[bound]
        lines.append(f"| {r['name']} | {v} | {sign} {r['target']:.1f} | {result} | {r['meaning']} |")
    m = res["memory"]
    lines.append(f"| RSS after {m['forwarded']:,} keys | {m['rss_mib']:.1f} MiB | "
                 f"≤ {RSS_TARGET_MIB} MiB | {'met' if m['met'] else 'NOT met'} | "
                 f"resident memory of a fresh gateway ({m['store']}) after one PUT to each of "
                 f"{m['keys_requested']:,} new keys |")
    return lines


def ceiling_lines(res):
    """The ceilings section of the markdown report."""
    rows = res.get("ceilings", [])
    if not any(c["ceiling"] for c in rows):
        return ["Not computed: Postgres's CPU was not seen (a server on another machine), "
                "or a run's costs are missing."]
    nproc = res["meta"]["machine"]["nproc"]
    get_us = next(c["get_machine_us"] for c in rows if c["ceiling"])
    lines = [
        "The most each ratio against (g) could be on this machine if fencegate's own work "
        "for such a write, beyond passing a GET through, cost nothing: "
        f"{nproc} cores' time over what a (c) answer took of the whole machine "
        f"({get_us:.1f} µs of CPU: wrk, nginx, fencegate and the kernel, the cheapest of "
        "(c)'s runs) plus what Postgres's server processes spent per answer of the "
        "scenario (its cheapest run), divided by (g). The kernel's work writing and "
        "flushing the WAL, a PUT's body, the gate and the hand-off to the store are not "
        "counted, so fencegate stays below its ceiling. A target above its ceiling cannot be "
        "met on this machine while Postgres does the work per write it did in this run, "
        "whatever fencegate's own cost (bench/README.md, \"What this machine allows\").",
        "",
        "| ratio | measured | ceiling | target | Postgres µs per answer | |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for c in rows:
        if c["ceiling"] is None:
            continue
        measured = "n/a" if c["value"] is None else f"{c['value']:.2f}"
        reach = ("within the ceiling" if c["target"] <= c["ceiling"]
                 else "above the ceiling: not reachable here")
        lines.append(f"| {c['name']} | {measured} | {c['ceiling']:.2f} | ≥ {c['target']:.1f} "
                     f"| {c['pg_us']:.1f} | target {reach} |")
    return lines


def plain(res):
    """Fixed-width table for the terminal."""
    out = []
    w = max(len(s["name"]) for s in res["scenarios"]) + 4
    out.append(f"{'scenario':<{w}} {'req/s':>12} {'p50':>10} {'p99':>10}  notes")
    for s in res["scenarios"]:
        rps = f0(s["rps"]) + (" tps" if s["unit"] == "tps" else "")
        p50 = "-" if s["p50_ms"] is None else f"{s['p50_ms']:.2f}ms"
        p99 = "-" if s["p99_ms"] is None else f"{s['p99_ms']:.2f}ms"
        out.append(f"{'(' + s['id'] + ') ' + s['name']:<{w}} {rps:>12} {p50:>10} {p99:>10}  "
                   f"{'; '.join(s['notes'])}")
    out.append("")
    out.append(f"{'ratio':<8} {'value':>8} {'target':>10}  result")
    for r, v, bound, result in target_rows(res):
        out.append(f"{r['name']:<8} {v:>8} {bound + ' ' + format(r['target'], '.1f'):>10}  "
                   f"{result}   ({r['meaning']})")
    for c in res.get("ceilings", []):
        if c["ceiling"] is not None:
            out.append(f"{c['name']:<8} ceiling {c['ceiling']:.2f} on this machine (target "
                       f"{c['target']:.1f}; a (c) GET {c['get_machine_us']:.1f} us of the machine, "
                       f"Postgres {c['pg_us']:.1f} us per answer)")
    out.append("")
    out.append("machine: " + pulse_summary(res["meta"].get("pulses", {})))
    out.append("autogroup: " + res["meta"].get("autogroup", "not recorded"))
    m = res["memory"]
    out.append(f"{'RSS':<8} {m['rss_mib']:>5.1f}MiB {'<= ' + str(RSS_TARGET_MIB) + 'MiB':>10}  "
               f"{'met' if m['met'] else 'NOT met'}   (after {m['forwarded']:,} forwarded PUTs to new "
               f"keys; RSS at start {m['rss_start_mib']:.1f} MiB, peak {m['hwm_mib']:.1f} MiB; {m['store']})")
    return "\n".join(out)


def pulse_summary(found):
    if not found:
        return "not recorded."
    worst_steal = max(found.items(), key=lambda kv: kv[1]["steal_pct"])
    worst_late = max(found.items(), key=lambda kv: kv[1]["longest_late_ms"])
    disturbed = [run for run, p in found.items() if p["disturbed"]]
    return (f"{len(found)} runs; the host's steal was at most {worst_steal[1]['steal_pct']:.2f}% "
            f"of the CPU time (run {worst_steal[0]}), and a 50 ms sleep woke at most "
            f"{worst_late[1]['longest_late_ms']:,.0f} ms late (run {worst_late[0]}). "
            + (f"Disturbed (steal ≥ {STEAL_FLAG_PCT:g}% or a wake-up ≥ {LATE_FLAG_MS} ms "
               f"late), so not comparable with the other runs: {', '.join(disturbed)}; their "
               "scenarios' notes say so." if disturbed else
               f"None was disturbed (steal ≥ {STEAL_FLAG_PCT:g}% or a wake-up ≥ "
               f"{LATE_FLAG_MS} ms late)."))


def markdown(res, svg_link):
    meta = res["meta"]
    mach = meta["machine"]
    v = meta["versions"]
    mem = res["memory"]
    by = {s["id"]: s for s in res["scenarios"]}
    dirty = (" — the working tree had uncommitted changes under src/, tests/ or the manifests "
             "when the gateway was built" if meta["dirty"] else "")
    e_share = by["e"].get("share_409")
    lines = [
        "# Benchmarks",
        "",
        "Generated by `bench/run.sh`; do not edit by hand — re-run it. What each scenario "
        "measures and the caveats are in [bench/README.md](bench/README.md).",
        "",
        f"- **Date:** {meta['date']}",
        f"- **Machine:** {mach['nproc']} cores, {mach['cpu']}, {mach['memory_gib']} GiB memory, "
        f"Linux {mach['kernel']}",
        f"- **Commit:** `{meta['commit']}`{dirty}, built with the `{meta['profile']}` profile",
        f"- **Command:** `{meta['command']}` ({meta['mode']} run: {meta['duration_s']} s per scenario, "
        f"{meta['conns']} connections, {meta['nkeys']:,} keys)",
        f"- **Tools:** {v['wrk']}; bench/pace; {v['oha']}; {v['nginx']}; {v['pgbench']}; "
        f"PostgreSQL server {v['postgres']}",
        "",
        "Everything ran on the same machine in one run, one scenario after another: load "
        "generator, nginx, fencegate and Postgres share the 2 cores, so absolute numbers are "
        "low and noisy; the ratios between scenarios of the same run are what to compare.",
        "",
        "## Results",
        "",
        "req/s: wrk, closed loop, 64 connections. p50/p99: `bench/pace`, open loop at about "
        "half of the req/s measured just before (rate in the notes), 64 connections, each "
        "request's latency counted from when it was due if it could not be sent then; "
        "random keys (`{LO-HI}` in the notes).",
        "",
    ]
    lines += table_lines(res)
    lines += [
        "",
        "## Ratios against the targets",
        "",
    ]
    lines += ratio_lines(res)
    lines += [
        "",
        f"A missed target is reported, not failed: `bench/run.sh` exits 0 either way.",
        "",
        f"![Throughput per scenario]({svg_link})",
        "",
        "## What this machine allows",
        "",
    ]
    lines += ceiling_lines(res)
    lines += [
        "",
        "## Notes on this run",
        "",
        f"- (e) counts only 2xx answers as throughput"
        + (f"; {e_share * 100:.2f}% of its answers were 409" if e_share is not None else "")
        + " (a request overtaken on the wire by a newer token for the same key).",
        "- (e) latency: pace sends the same header on every request, so its open-loop run sends "
        "token 1 to a fresh random key per request; each request still raises its key's token "
        "(from none to 1).",
        f"- (g) is Postgres alone running the single-row conditional upsert "
        f"(`bench/pgbench_upsert.sql`) with 64 clients and `synchronous_commit=on`, the "
        f"setting the gateway forces on its own connections; the gateway was stopped while "
        f"it ran.",
        "- (h) sends every POST with an Idempotency-Key never used before (and the key's "
        "current token): the in-flight record (its insert is the lookup) and the stored "
        "answer, two store statements that commit, each group-committed with concurrent "
        "first uses', against (g)'s one statement per write; pace has no run of (h), as it "
        "sends one header value per run. (i) replays one stored answer from the gateway's "
        "memory (it stored it): no store read, nothing forwarded; compared with (c), a GET "
        "passed through to nginx. A cached record costs about 1.3 KB of memory plus its "
        "body (docs/internals/store-protocol.md), within a bound of 32 MiB.",
        f"- Memory: {mem['method']}; {mem['forwarded']:,} writes forwarded "
        f"(answers: {', '.join(f'{k}: {v:,}' for k, v in sorted(mem['status'].items()))}); at {f0(mem['rps'])} req/s closed loop; RSS "
        f"{mem['rss_start_mib']:.1f} MiB after start, {mem['rss_mib']:.1f} MiB after the writes, "
        f"peak (VmHWM) {mem['hwm_mib']:.1f} MiB. Store: {mem['store']}; this check measures the "
        "gateway's own memory (SQLite's page cache inside the process is bounded), and a "
        "tmpfs file only makes its commits cheaper, so the run is shorter.",
        f"- Load average (1, 5, 15 min) when the script started, before it built or ran "
        f"anything: {meta['loadavg_start']}. Well above 0 means other work (a build, a test "
        "run) was sharing the 2 cores, and may have gone on during the run.",
        f"- Linux's autogroup (a scheduling group per session) during the run: "
        f"{meta['autogroup']}. With it on, Postgres (started in another session) gets "
        "the CPUs' share of a group against the run's processes, and its backends waited "
        "up to 1.6 s for a CPU under the GET load (see `autogroup_off` in bench/lib.sh).",
        "- The machine during each measured run (`bench/util.py pulse`): "
        + pulse_summary(meta["pulses"]),
        f"- 503 answers (store unavailable) during (c)-(f), (h) and (i): {meta['store_unavailable']}; "
        f"during (j): {meta.get('store_unavailable_j', 0)}.",
        "- (j) is (e) through one gateway in `shared` mode (its own database): each write is "
        "admitted, and after the upstream is done left, by `fencegate_admit_batch`, whose "
        "batches carry the admissions and leaves of concurrent writes in one statement and "
        "one commit: two batch items per write, against (g)'s one statement per write.",
        "- (m) and (n): HTTP/2 by prior knowledge (h2c) from h2load to the proxy, 4 connections "
        "with 32 streams each, HTTP/1.1 to the upstream; two alternated runs each.",
        "- (o) and (p): raising fenced PUTs from bench/volley (hyper's client for both) through "
        "the gateway of (c)-(f), 64 HTTP/1.1 connections against 4 h2c connections with 16 "
        "streams each, each run on keys new to the store; two alternated runs each.",
        "- (q) and (r): gRPC unary writes (`bank.Ledger/Debit` of tests/it/grpc/server.py, "
        "Python's grpcio) from h2load, 4 connections with 16 streams each, direct and through "
        "a gateway on Postgres whose route fences the method (h2c upstream), one token for "
        "every write (the current token, as in (d)); two alternated runs each.",
        "- (k) and (l): TLS 1.3 from wrk to the proxy, plain HTTP to the upstream; both proxies "
        "serve the same ECDSA P-256 certificate made for the run, and wrk keeps its 64 "
        "connections, so handshakes are not what is measured. (b) is also run open loop at "
        "(c)'s open-loop rate, for the latency comparison.",
        "",
        "## How to reproduce",
        "",
        "```sh",
        "# Postgres on 127.0.0.1:5432, user postgres, trust auth (what .ci/run starts)",
        "bash bench/run.sh            # full run, a few minutes; writes BENCHMARKS.md and bench/throughput.svg",
        "bash bench/run.sh --smoke    # ~1 s per scenario, proves the harness works; writes nothing",
        "BENCH_KEEP=1 bash bench/run.sh --smoke   # keep the temp dir: configs, logs, raw tool outputs",
        "BENCH_PROFILE=release bash bench/run.sh --no-write   # the quick start's profile instead of dist",
        "```",
        "",
        "The script installs what is missing (`apt-get install nginx wrk postgresql-client`, "
        "`cargo install oha --locked`), builds `cargo build --profile dist` and `bench/pace`, starts nginx and "
        "fencegate on free 127.0.0.1 ports in a temp dir, creates and drops the database "
        "`fg_bench_<pid>`, and cleans everything up on exit. Stop other work on the machine "
        "first: a parallel build or test run shows up directly in these numbers.",
        "",
    ]
    # The hand-written analysis (reasons for misses, micro-benchmarks, before
    # and after numbers) stays next to this script: the report is the latest
    # run only, and links to it.
    lines += [
        "## Analysis",
        "",
        "Why targets are missed or met, micro-benchmarks and before/after "
        "measurements of changes: [bench/analysis.md](bench/analysis.md).",
        "",
    ]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", default="full")
    p.add_argument("--duration", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--conns", type=int, default=64)
    p.add_argument("--nkeys", type=int, default=10000)
    p.add_argument("--mem-keys", type=int, default=1000000)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--profile", default="dist")
    p.add_argument("--dirty", default="0")
    p.add_argument("--command", default="bash bench/run.sh")
    p.add_argument("--oha-version", default="oha")
    p.add_argument("--wrk-version", default="wrk")
    p.add_argument("--nginx-version", default="nginx")
    p.add_argument("--pgbench-version", default="pgbench")
    p.add_argument("--pg-version", default="unknown")
    p.add_argument("--json")
    p.add_argument("--markdown")
    p.add_argument("--svg-link", default="bench/throughput.svg")
    a = p.parse_args()
    res = build(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    print(plain(res))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown(res, a.svg_link))
    return 0


if __name__ == "__main__":
    sys.exit(main())
