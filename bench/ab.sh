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
# Each round runs every binary, in a new order each round. Per round and
# binary: nginx (`return 200`) as the upstream, Postgres
# database `fg_ab_<pid>` dropped and created again, `fencegate serve` with
# bench/lib.sh's routes (single mode; --shared for shared mode; --store adds
# lines to [store], e.g. 'cache_keys = 10'), keys k0..k9999 and h0..h9999
# seeded with token 1 (and the answer `replay` replays stored), then
# `wrk -t2 -c64 -d<S>s` of each scenario in turn. CPU per 2xx answer is taken
# from /proc: fencegate's process, and every Postgres server process alive at
# the end of the run (backends a gateway opens during it included; see
# `pg_ticks_since` in bench/lib.sh). "2xx/xact" is 2xx answers per Postgres
# transaction that wrote during the run (counted by transaction ids, which
# only writing transactions take): for raising writes, the mean number of
# decisions per fence batch.
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
require_tools ab.sh nginx wrk psql curl python3

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
    autogroup_restore
}
trap cleanup EXIT
# See autogroup_off in bench/lib.sh.
autogroup_note "$W/autogroup.txt"

nginx_upstream_conf "$W" "$P_UP"
nginx -p "$W/up" -c "$W/up/nginx.conf" -g 'daemon off;' & NGX=$!

fg_conf "$W/fencegate.toml" "$P_FG" "$P_ADM" "postgres://$PGUSER@$PGHOST:$PGPORT/$DB" "$MODE" \
    "$P_UP" "$STORE_LINES"

echo "bench/ab.sh: ${#BINS[@]} binaries x $ROUNDS rounds, $MODE mode, wrk -t2 -c64 -d${SECONDS_PER}s; outputs in $W"
printf '%-3s %-28s %-7s %10s %12s %12s %8s %s\n' rnd binary mode "2xx/s" "fg us/2xx" "pg us/2xx" "2xx/xact" note
for round in $(seq 1 "$ROUNDS"); do
    # A new order each round (the binaries rotated): the one run first in a
    # round ran 5-7% faster in each of two sets of three rounds that kept one
    # order, which would otherwise count for or against one binary.
    order=()
    for i in "${!BINS[@]}"; do order+=("${BINS[$(((i + round - 1) % ${#BINS[@]}))]}"); done
    for bin in "${order[@]}"; do
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
            before=$(ticks "$FG"); pg_snapshot > "$W/pg_before"; xid0=$(xact_id)
            wrk -t2 -c64 -d"${SECONDS_PER}s" -s "$REPO/bench/fenced.lua" "http://127.0.0.1:$P_FG" \
                -- "$sc" 10000 "$prefix" 2 > "$W/wrk.txt"
            after=$(ticks "$FG")
            xacts=$(( $(xact_id) - xid0 - 1 ))   # the second xact_id took one
            per=2xx
            [ "$sc" = stale ] && per=all   # every answer a 409
            printf '%-3s %-28s %-7s ' "$round" "$(basename "$bin" | cut -c1-28)" "$sc"
            python3 "$REPO/bench/util.py" cost "$W/wrk.txt" "$((after - before))" \
                "$(pg_ticks_since "$W/pg_before")" "$per" "$xacts"
        done
        if grep -q "single-writer lock" "$W/fencegate.log"; then
            echo "    note: this gateway logged about its single-writer lock (see $W/fencegate.log)"
        fi
    done
done
