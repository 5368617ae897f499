#!/usr/bin/env bash
# Two (or more) fencegate binaries side by side: alternated rounds of the same
# scenarios, each round on a fresh Postgres database and a fresh gateway
# process, with req/s and CPU per request of fencegate and of Postgres.
#
#   bash bench/ab.sh [--rounds N] [--seconds S] [--shared] [--store 'LINES']
#                    BINARY... -- SCENARIO...
#
# SCENARIO is a bench/fenced.lua mode: get, reuse, stale, raise, fresh,
# replay. Example, a change against its base:
#
#   bash bench/ab.sh /tmp/base /tmp/change -- fresh raise
#
# Per round and binary: nginx (`return 200`) as the upstream, Postgres
# database `fg_ab_<pid>` dropped and created again, `fencegate serve` with
# bench/lib.sh's routes (single mode; --shared for shared mode; --store adds
# lines to [store], e.g. 'cache_keys = 10'), keys k0..k9999 and h0..h9999
# seeded with token 1 (and the answer `replay` replays stored), then
# `wrk -t2 -c64 -d<S>s` of each scenario in turn. CPU per 2xx answer is taken
# from /proc: fencegate's process, and every Postgres server process alive at
# the end of the run (backends a gateway opens during it included).
#
# Why a script: an A/B by hand is easily wrong. A gateway stopped with a
# signal drains before it exits; one still draining when the next round's
# database is created under the same name can take its single-writer lock
# there first, and the next gateway then decides nothing from memory for a
# while (every write goes to the store): its round measures another path.
# This script waits for each gateway to exit before the next round starts.
#
# Speeds are compared only within one invocation: alternated rounds share
# whatever else the machine is doing. Nothing here asserts a speed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=bench/lib.sh
. "$REPO/bench/lib.sh"
export PATH="$PATH:/usr/sbin:/sbin"
for tool in nginx wrk psql python3; do
    command -v "$tool" >/dev/null 2>&1 || { echo "ab.sh: $tool is not installed" >&2; exit 1; }
done

ROUNDS=2 SECONDS_PER=8 MODE=single STORE_LINES=""
BINS=() SCENARIOS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) ROUNDS=$2; shift 2 ;;
        --seconds) SECONDS_PER=$2; shift 2 ;;
        --shared) MODE=shared; shift ;;
        --store) STORE_LINES=$2; shift 2 ;;
        --) shift; SCENARIOS=("$@"); break ;;
        *) BINS+=("$1"); shift ;;
    esac
done
[ ${#BINS[@]} -ge 1 ] && [ ${#SCENARIOS[@]} -ge 1 ] \
    || { echo "usage: bench/ab.sh [options] BINARY... -- SCENARIO..." >&2; exit 2; }
for b in "${BINS[@]}"; do [ -x "$b" ] || { echo "ab.sh: $b is not executable" >&2; exit 2; }; done

export PGHOST="${PGHOST:-127.0.0.1}" PGPORT="${PGPORT:-5432}" PGUSER="${PGUSER:-postgres}"
W="$(mktemp -d "${TMPDIR:-/tmp}/fg-ab.XXXXXX")"
chmod 755 "$W"   # nginx workers run as nobody
mapfile -t PORTS < <(python3 "$REPO/bench/util.py" ports 3)
P_UP=${PORTS[0]} P_FG=${PORTS[1]} P_ADM=${PORTS[2]}
DB="fg_ab_$$"
NGX="" FG=""

# Stops a gateway and waits until it has exited (see above).
stop_gateway() {
    [ -n "$FG" ] || return 0
    kill "$FG" 2>/dev/null || true
    for _ in $(seq 1 100); do
        kill -0 "$FG" 2>/dev/null || { wait "$FG" 2>/dev/null || true; FG=""; return 0; }
        sleep 0.1
    done
    kill -9 "$FG" 2>/dev/null || true
    wait "$FG" 2>/dev/null || true
    FG=""
}
cleanup() {
    stop_gateway
    [ -n "$NGX" ] && kill "$NGX" 2>/dev/null || true
    wait 2>/dev/null || true
    psql -qX -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT

mkdir -p "$W/up/logs"
cat > "$W/up/nginx.conf" <<EOF
worker_processes 2;
pid $W/up/nginx.pid;
error_log $W/up/logs/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    keepalive_requests 1000000;
    client_body_temp_path $W/up/cb; proxy_temp_path $W/up/p;
    fastcgi_temp_path $W/up/f; uwsgi_temp_path $W/up/u; scgi_temp_path $W/up/s;
    server { listen 127.0.0.1:$P_UP; location / { return 200 "ok"; } }
}
EOF
nginx -p "$W/up" -c "$W/up/nginx.conf" -g 'daemon off;' & NGX=$!

cat > "$W/fencegate.toml" <<EOF
[server]
listen = "127.0.0.1:$P_FG"
admin_listen = "127.0.0.1:$P_ADM"
[store]
url = "postgres://$PGUSER@$PGHOST:$PGPORT/$DB"
mode = "$MODE"
$STORE_LINES
[locks]
enabled = false
EOF
fg_routes "$P_UP" >> "$W/fencegate.toml"

HZ=$(getconf CLK_TCK)
ticks() { # CPU clock ticks (user + system) of the given processes
    local t=0 p f
    for p in "$@"; do
        read -r -a f < "/proc/$p/stat" 2>/dev/null || continue
        t=$((t + f[13] + f[14]))
    done
    echo "$t"
}
# Every Postgres server process now, with its ticks: a process that started
# during a run counts whole at its end (it had none at the start).
pg_snapshot() {
    local p
    for p in $(pgrep -u postgres -x postgres || true); do
        echo "$p $(ticks "$p")"
    done
}

echo "bench/ab.sh: ${#BINS[@]} binaries x $ROUNDS rounds, $MODE mode, wrk -t2 -c64 -d${SECONDS_PER}s; outputs in $W"
printf '%-3s %-28s %-7s %10s %12s %12s %s\n' rnd binary mode "2xx/s" "fg us/2xx" "pg us/2xx" note
for round in $(seq 1 "$ROUNDS"); do
    for bin in "${BINS[@]}"; do
        stop_gateway
        psql -qX -d postgres -c "SET client_min_messages = warning" \
            -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB" >/dev/null
        RUST_LOG=warn "$bin" serve --config "$W/fencegate.toml" 2>"$W/fencegate.log" & FG=$!
        python3 "$REPO/bench/util.py" wait-http "http://127.0.0.1:$P_FG/docs/k1" 60 "$FG" \
            || { cat "$W/fencegate.log" >&2; exit 1; }
        python3 "$REPO/bench/util.py" seed "http://127.0.0.1:$P_FG" k 10000 1 >/dev/null
        python3 "$REPO/bench/util.py" seed "http://127.0.0.1:$P_FG" h 10000 1 >/dev/null
        curl -fsS -o /dev/null -X POST -H 'X-Fence-Token: 1' -H 'Content-Type: text/plain' \
            -H 'Idempotency-Key: bench-replay' -d written-by-bench "http://127.0.0.1:$P_FG/keyed/h1"
        for sc in "${SCENARIOS[@]}"; do
            case "$sc" in
                fresh | replay) prefix=h ;;
                raise) prefix="r$round-" ;;
                *) prefix=k ;;
            esac
            before=$(ticks "$FG"); pg_snapshot > "$W/pg_before"
            wrk -t2 -c64 -d"${SECONDS_PER}s" -s "$REPO/bench/fenced.lua" "http://127.0.0.1:$P_FG" \
                -- "$sc" 10000 "$prefix" 2 > "$W/wrk.txt"
            after=$(ticks "$FG"); pg_snapshot > "$W/pg_after"
            python3 - "$W/wrk.txt" "$W/pg_before" "$W/pg_after" "$((after - before))" "$HZ" \
                "$round" "$(basename "$bin")" "$sc" <<'EOF'
import json, re, sys
text = open(sys.argv[1]).read()
stats = json.loads(next(l for l in text.splitlines() if l.startswith("BENCHJSON "))[10:])
secs = float(re.search(r"requests in ([\d.]+)s", text).group(1))
def snap(path):
    return {int(p): int(t) for p, t in (l.split() for l in open(path) if l.strip())}
before, after = snap(sys.argv[2]), snap(sys.argv[3])
pg = sum(t - before.get(p, 0) for p, t in after.items())
hz, ok = int(sys.argv[5]), stats["s2xx"]
fg_us = int(sys.argv[4]) / hz * 1e6 / max(ok, 1)
pg_us = pg / hz * 1e6 / max(ok, 1)
other = stats["requests"] - ok
note = f"{other} not 2xx" if other and sys.argv[8] != "stale" else ""
if sys.argv[8] == "stale":
    # Every answer is a 409: the rate and CPU are per answer.
    ok = stats["requests"]
    fg_us = int(sys.argv[4]) / hz * 1e6 / max(ok, 1)
    pg_us = pg / hz * 1e6 / max(ok, 1)
    note = "per 409"
print(f"{sys.argv[6]:<3} {sys.argv[7][:28]:<28} {sys.argv[8]:<7} {ok / secs:>10,.0f} {fg_us:>12.1f} {pg_us:>12.1f} {note}")
EOF
        done
        if grep -q "single-writer lock" "$W/fencegate.log"; then
            echo "    note: this gateway logged about its single-writer lock (see $W/fencegate.log)"
        fi
    done
done
