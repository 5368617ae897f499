#!/usr/bin/env bash
# Where the pass-through path spends its CPU, next to nginx doing the same job;
# or, with --raise, where a raising fenced write spends it, in fencegate and
# in Postgres; or, with --keyed, what an Idempotency-Key first use and a
# replay cost.
#
#   bash bench/profile.sh [BINARY]
#   bash bench/profile.sh --raise [--shared] [BINARY]
#   bash bench/profile.sh --keyed [--shared] [BINARY]
#   bash bench/profile.sh --instructions [BINARY]
#
# --instructions: fencegate (SQLite store) under valgrind's callgrind;
# user-space instructions per request for a GET passed through, a PUT
# with the key's current token and a stale PUT answered 409 (bench/run.sh's
# (c), (d) and (f)), 10,000 each
# (INSTR_REQUESTS) from oha at 16 connections. A count, not a time: it
# repeats within a fraction of a percent on a busy machine, where CPU
# times of the same code move by 20%, so it shows what a change of the
# request path saves. Needs valgrind, oha and curl. No profile.
#
# --raise: fencegate on a fresh Postgres database (single mode, or shared
# with --shared); wrk -t2 -c64 PUTs whose every request raises its key's
# token (bench/fenced.lua's `raise`). CPU per request is given for fencegate
# and for Postgres (every server process of the cluster, so keep the
# machine quiet), then fencegate is profiled as below.
#
# --keyed: the same Postgres setup and a route /keyed/{id} with
# `idempotency = "required"` (bench/run.sh's); the keys h0..h9999 seeded
# with token 1 and one answer stored (`POST /keyed/h1`, `Idempotency-Key:
# bench-replay`). Then rounds of wrk -t2 -c64 with bench/fenced.lua's
# `fresh` (every request a first use: (h) of run.sh) and `replay` (every
# request replays the stored answer: (i)), each with fencegate's and
# Postgres's CPU per request; then fencegate is profiled (as below) under
# first uses.
#
# Starts an nginx upstream (`return 200`), an nginx reverse proxy and
# fencegate (SQLite store: pass-through GETs never touch it) on free
# 127.0.0.1 ports, then:
#
#   1. CPU per request: wrk -t1 -c64 against the nginx proxy and fencegate,
#      alternated twice; for each run, the proxy process's CPU time (user +
#      system, from /proc) divided by the requests served. CPU per request is
#      steadier than req/s on a shared machine: it does not depend on how
#      the cores were divided among wrk, nginx and fencegate.
#   2. A CPU profile of fencegate under the same load: `perf record -e
#      cpu-clock -g` (software clock: works in VMs without PMU access),
#      reported as the kernel/user split and the top user-space symbols.
#
# BINARY defaults to a dist build with line tables (built into
# target/profile-build), so perf can name inlined frames. Needs perf
# (Debian: linux-perf), nginx and wrk. Raw outputs stay in the printed
# temp dir.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=bench/lib.sh
. "$REPO/bench/lib.sh"
export PATH="$PATH:/usr/sbin:/sbin"
require_tools profile.sh perf nginx wrk python3

SCENARIO=get
MODE=single
while [ $# -gt 0 ]; do
    case "$1" in
        --raise) SCENARIO=raise; shift ;;
        --keyed) SCENARIO=keyed; shift ;;
        --instructions) SCENARIO=instructions; shift ;;
        --shared) MODE=shared; shift ;;
        *) break ;;
    esac
done
BIN="${1:-}"
if [ -z "$BIN" ]; then
    echo "building dist with line tables into target/profile-build" >&2
    (cd "$REPO" && CARGO_PROFILE_DIST_DEBUG=line-tables-only \
        cargo build --profile dist --target-dir target/profile-build >&2)
    BIN="$REPO/target/profile-build/dist/fencegate"
fi

if [ "$SCENARIO" = instructions ]; then
    require_tools profile.sh valgrind callgrind_control callgrind_annotate oha curl
fi

W="$(mktemp -d "${TMPDIR:-/tmp}/fg-profile.XXXXXX")"
chmod 755 "$W"   # nginx workers run as nobody
mapfile -t PORTS < <(python3 "$REPO/bench/util.py" ports 4)
P_UP=${PORTS[0]} P_NGX=${PORTS[1]} P_FG=${PORTS[2]} P_ADM=${PORTS[3]}
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if [ -n "${DB:-}" ]; then
        psql -qX -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
    fi
    autogroup_restore
}
trap cleanup EXIT
# See autogroup_off in bench/lib.sh.
autogroup_note "$W/autogroup.txt"

nginx_upstream_conf "$W" "$P_UP"
nginx_proxy_conf "$W" "$P_UP" "$P_NGX"
STORE_URL="sqlite://$W/fences.db"
DB=""
if [ "$SCENARIO" = raise ] || [ "$SCENARIO" = keyed ]; then
    export PGHOST="${PGHOST:-127.0.0.1}" PGPORT="${PGPORT:-5432}" PGUSER="${PGUSER:-postgres}"
    DB="fg_profile_$$"
    psql -qX -d postgres -c "CREATE DATABASE $DB" >/dev/null
    STORE_URL="postgres://$PGUSER@$PGHOST:$PGPORT/$DB"
fi
fg_conf "$W/fencegate.toml" "$P_FG" "$P_ADM" "$STORE_URL" "$MODE" "$P_UP"

nginx -p "$W/up" -c "$W/up/nginx.conf" -g 'daemon off;' & PIDS+=($!); NGX_UP=$!
nginx -p "$W/px" -c "$W/px/nginx.conf" -g 'daemon off;' & PIDS+=($!); NGX_PX=$!
if [ "$SCENARIO" = instructions ]; then
    # Counted from the first request on (`callgrind_control -i on`), so
    # start-up is not in the counts.
    RUST_LOG=warn valgrind --tool=callgrind --instr-atstart=no \
        --callgrind-out-file="$W/callgrind.out.%p" \
        "$BIN" serve --config "$W/fencegate.toml" 2>"$W/fencegate.log" & PIDS+=($!); FG=$!
else
    RUST_LOG=warn "$BIN" serve --config "$W/fencegate.toml" 2>"$W/fencegate.log" & PIDS+=($!); FG=$!
fi
for p in "$P_UP" "$P_NGX" "$P_FG"; do
    python3 "$REPO/bench/util.py" wait-http "http://127.0.0.1:$p/docs/k1" 120 \
        || { cat "$W"/*/logs/*.log "$W/fencegate.log" >&2; exit 1; }
done

if [ "$SCENARIO" = instructions ]; then
    # User-space instructions per request, counted by callgrind: unlike CPU
    # time, the same code gives the same count (within a fraction of a
    # percent) however busy the machine is, so a change of a few percent
    # shows. The kernel's share (about two thirds of fencegate's CPU time,
    # see the profile below) is not counted.
    N=${INSTR_REQUESTS:-10000}
    url="http://127.0.0.1:$P_FG/docs/k1"
    put=(-m PUT -H 'X-Fence-Token: 1' -d written-by-bench)
    stale=(-m PUT -H 'X-Fence-Token: 0' -d written-by-bench)
    curl -fsS -X PUT -H 'X-Fence-Token: 1' -d written-by-bench "$url" >/dev/null
    # Warm-up, not counted: pooled connections, caches.
    oha -n 2000 -c 16 --no-tui "$url" >/dev/null 2>&1
    oha -n 2000 -c 16 --no-tui "${put[@]}" "$url" >/dev/null 2>&1
    oha -n 2000 -c 16 --no-tui "${stale[@]}" "$url" >/dev/null 2>&1
    echo "user-space instructions per request, $N requests from 16 connections (callgrind)"
    for what in get put stale; do
        callgrind_control -z "$FG" >/dev/null 2>&1
        callgrind_control -i on "$FG" >/dev/null 2>&1
        case $what in
            get) oha -n "$N" -c 16 --no-tui "$url" >/dev/null 2>&1 ;;
            put) oha -n "$N" -c 16 --no-tui "${put[@]}" "$url" >/dev/null 2>&1 ;;
            stale) oha -n "$N" -c 16 --no-tui "${stale[@]}" "$url" >/dev/null 2>&1 ;;
        esac
        callgrind_control -i off "$FG" >/dev/null 2>&1
        callgrind_control -d "$what" "$FG" >/dev/null 2>&1
        sleep 1
        out=$(grep -l "Trigger: dump $what" "$W"/callgrind.out.* | head -n1)
        total=$(callgrind_annotate "$out" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
        case $what in
            get) label="GET pass-through" ;;
            put) label="PUT, current token" ;;
            stale) label="PUT, stale (409)" ;;
        esac
        printf '%-20s %10d\n' "$label" "$((total / N))"
    done
    echo
    echo "raw outputs: $W (callgrind_annotate --inclusive=yes $W/callgrind.out.<pid>.<n>)"
    exit 0
fi

# One wrk run of bench/fenced.lua and the CPU it cost: label, mode, prefix.
# Prints 2xx answers per second, and fencegate's and Postgres's CPU per 2xx.
cpu_run() {
    local label=$1 mode=$2 prefix=$3 before after
    before=$(ticks "$FG"); pg_snapshot > "$W/pg_before"
    wrk -t2 -c64 -d8s -s "$REPO/bench/fenced.lua" "http://127.0.0.1:$P_FG" \
        -- "$mode" 10000 "$prefix" 2 > "$W/wrk_$label.txt"
    after=$(ticks "$FG")
    printf '%-10s ' "$label"
    python3 "$REPO/bench/util.py" cost "$W/wrk_$label.txt" "$((after - before))" \
        "$(pg_ticks_since "$W/pg_before")"
}

# fencegate profiled for 8 s under wrk (whose load must last 12 s: it
# starts 2 s before), reported as the kernel/user split and the top `$1`
# user-space symbols.
profile_fg() { # number of symbols, wrk arguments
    local top=$1 load
    shift
    wrk "$@" > /dev/null &
    load=$!
    sleep 2
    perf record -q -e cpu-clock -F 2000 -g -p "$FG" -o "$W/perf.data" -- sleep 8 2>/dev/null
    wait "$load"
    set +o pipefail   # head closes the pipes early
    perf report -i "$W/perf.data" --no-children --sort dso --stdio -g none 2>/dev/null \
        | grep '%' | head -5
    echo
    echo "top user-space symbols (self time)"
    perf report -i "$W/perf.data" --no-children --sort sym --stdio -g none 2>/dev/null \
        | grep '%' | grep -v '\[k\]' | head -"$top" | cut -c1-150
    echo
    echo "raw outputs: $W (perf report -i $W/perf.data)"
}

if [ "$SCENARIO" = keyed ]; then
    python3 "$REPO/bench/util.py" seed "http://127.0.0.1:$P_FG" h 10000 1 >&2
    stored=$(python3 - "$P_FG" <<'EOF'
import http.client, sys
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=10)
c.request("POST", "/keyed/h1", body=b"written-by-bench", headers={
    "X-Fence-Token": "1", "Content-Type": "text/plain", "Idempotency-Key": "bench-replay"})
print(c.getresponse().status)
EOF
)
    [ "$stored" = 200 ] || { echo "profile.sh: storing the replayed answer failed ($stored)" >&2; exit 1; }
    echo "CPU per keyed POST ($MODE mode), wrk -t2 -c64 -d8s (one line per run)"
    printf '%-10s %10s %12s %12s\n' run "2xx/s" "fg us/2xx" "pg us/2xx"
    for round in 1 2 3; do
        cpu_run "fresh-$round" fresh h
        cpu_run "replay-$round" replay h
    done
    echo
    echo "perf record -e cpu-clock -g on fencegate, 8 s under wrk -t2 -c64 fresh"
    profile_fg 40 -t2 -c64 -d12s -s "$REPO/bench/fenced.lua" "http://127.0.0.1:$P_FG" \
        -- fresh 10000 h 2
    exit 0
fi

if [ "$SCENARIO" = raise ]; then
    echo "CPU per raising fenced write ($MODE mode), wrk -t2 -c64 -d8s (one line per run)"
    printf '%-10s %10s %12s %12s\n' run "2xx/s" "fg us/2xx" "pg us/2xx"
    for round in 1 2 3; do
        cpu_run "raise-$round" raise "r$round-"
    done
    echo
    echo "perf record -e cpu-clock -g on fencegate, 8 s under wrk -t2 -c64 raise"
    profile_fg 30 -t2 -c64 -d12s -s "$REPO/bench/fenced.lua" "http://127.0.0.1:$P_FG" \
        -- raise 10000 rp- 2
    exit 0
fi

# CPU per request, by process: the proxy's own (user and system), the
# upstream nginx's, and the whole machine's (the rest is mostly wrk); and
# how often the proxy's threads switched out per request, waiting for work
# (voluntarily) or preempted. A proxy's cost does not stop at its own
# process: how it reads and writes changes what the upstream and the load
# generator spend per request too.
echo "CPU per request, wrk -t1 -c64 -d5s GET (one line per run)"
printf '%-12s %9s %9s %6s %6s %9s %9s %8s %8s\n' proxy req/s "us/req" user sys \
    upstream machine "vol/req" "inv/req"
for round in 1 2; do
    for pair in "nginx-proxy:$P_NGX:$NGX_PX" "fencegate:$P_FG:$FG"; do
        IFS=: read -r name port pid <<<"$pair"
        before="$(proc_counts "$pid") $(ticks "$NGX_UP") $(machine_ticks)"
        wrk -t1 -c64 -d5s "http://127.0.0.1:$port/docs/k1" > "$W/wrk_${name}_$round.txt"
        after="$(proc_counts "$pid") $(ticks "$NGX_UP") $(machine_ticks)"
        python3 "$REPO/bench/util.py" split "$W/wrk_${name}_$round.txt" "$name" \
            "$before" "$after"
    done
done

echo
echo "perf record -e cpu-clock -g on fencegate, 8 s under wrk -t1 -c64"
profile_fg 25 -t1 -c64 -d12s "http://127.0.0.1:$P_FG/docs/k1"
