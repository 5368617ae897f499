#!/usr/bin/env bash
# The floor under an HTTP/1 path of fencegate's own, measured next to the
# nginx proxy and fencegate: bench/floor (a proxy that does per request only
# what such a path could not leave out, on the same runtime and worker model:
# see its crate docs) passes GETs through, as bench/run.sh's (b) and (c) do.
#
#   bash bench/floor.sh [--rounds N] [--seconds S] [--threads T] [FENCEGATE]
#
# Rounds of wrk -tT -c64 (T = 2, as in bench/run.sh, by default) against the
# three proxies in turn, each round in a new order; per run, req/s and CPU per
# request by process (util.py split), and the host's steal and the longest
# late wake-up (util.py pulse). Then each proxy's median req/s and its ratio
# to nginx's. FENCEGATE defaults to target/dist/fencegate (built if
# missing). Needs nginx and wrk.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=bench/lib.sh
. "$REPO/bench/lib.sh"
export PATH="$PATH:/usr/sbin:/sbin"
require_tools floor.sh nginx wrk python3 cargo

ROUNDS=5 SECONDS_PER_RUN=8 THREADS=2
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) ROUNDS=$2; shift 2 ;;
        --seconds) SECONDS_PER_RUN=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        *) break ;;
    esac
done
FG_BIN="${1:-$REPO/target/dist/fencegate}"
if [ ! -x "$FG_BIN" ]; then
    (cd "$REPO" && cargo build --profile dist --locked >&2)
fi
(cd "$REPO/bench/floor" && cargo build --release --quiet >&2)
FLOOR_BIN="$REPO/bench/floor/target/release/floor"

W="$(mktemp -d "${TMPDIR:-/tmp}/fg-floor.XXXXXX")"
chmod 755 "$W"   # nginx workers run as nobody
mapfile -t PORTS < <(python3 "$REPO/bench/util.py" ports 5)
P_UP=${PORTS[0]} P_NGX=${PORTS[1]} P_FLOOR=${PORTS[2]} P_FG=${PORTS[3]} P_ADM=${PORTS[4]}
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    autogroup_restore
}
trap cleanup EXIT
# See autogroup_off in bench/lib.sh.
autogroup_note "$W/autogroup.txt"

nginx_upstream_conf "$W" "$P_UP"
nginx_proxy_conf "$W" "$P_UP" "$P_NGX"
fg_conf "$W/fencegate.toml" "$P_FG" "$P_ADM" "sqlite://$W/fences.db" single "$P_UP"

nginx -p "$W/up" -c "$W/up/nginx.conf" -g 'daemon off;' & PIDS+=($!); NGX_UP=$!
nginx -p "$W/px" -c "$W/px/nginx.conf" -g 'daemon off;' & PIDS+=($!); NGX_PX=$!
"$FLOOR_BIN" "127.0.0.1:$P_FLOOR" "127.0.0.1:$P_UP" & PIDS+=($!); FLOOR=$!
RUST_LOG=warn "$FG_BIN" serve --config "$W/fencegate.toml" 2>"$W/fencegate.log" & PIDS+=($!); FG=$!
for p in "$P_UP" "$P_NGX" "$P_FLOOR" "$P_FG"; do
    python3 "$REPO/bench/util.py" wait-http "http://127.0.0.1:$p/docs/k1" 120 \
        || { cat "$W"/*/logs/*.log "$W/fencegate.log" >&2; exit 1; }
done
# Warm-up, not recorded.
for p in "$P_NGX" "$P_FLOOR" "$P_FG"; do
    wrk -t"$THREADS" -c64 -d2s "http://127.0.0.1:$p/docs/k1" >/dev/null
done

echo "GETs passed through, wrk -t$THREADS -c64 -d${SECONDS_PER_RUN}s, $ROUNDS rounds (one line per run)"
printf '%-12s %9s %9s %6s %6s %9s %9s %8s %8s %7s %8s\n' proxy req/s "us/req" user sys \
    upstream machine "vol/req" "inv/req" steal% "late ms"
PAIRS=("nginx-proxy:$P_NGX:$NGX_PX" "floor:$P_FLOOR:$FLOOR" "fencegate:$P_FG:$FG")
for round in $(seq 1 "$ROUNDS"); do
    # A new order each round: whatever drifts during a round (the host, the
    # page cache, the CPU's clock) is not always on the same proxy.
    order=()
    for i in 0 1 2; do order+=("${PAIRS[$(((i + round) % 3))]}"); done
    for pair in "${order[@]}"; do
        IFS=: read -r name port pid <<<"$pair"
        python3 "$REPO/bench/util.py" pulse "$W/pulse_${name}_$round.json" & pulse=$!
        before="$(proc_counts "$pid") $(ticks "$NGX_UP") $(machine_ticks)"
        wrk -t"$THREADS" -c64 -d"${SECONDS_PER_RUN}s" "http://127.0.0.1:$port/docs/k1" \
            > "$W/wrk_${name}_$round.txt"
        after="$(proc_counts "$pid") $(ticks "$NGX_UP") $(machine_ticks)"
        kill -TERM "$pulse"; wait "$pulse" || true
        line=$(python3 "$REPO/bench/util.py" split "$W/wrk_${name}_$round.txt" "$name" \
            "$before" "$after")
        echo "$line $(python3 "$REPO/bench/util.py" pulse-line "$W/pulse_${name}_$round.json")"
        echo "$line" | awk -v n="$name" '{ print n, $2 }' >> "$W/rates.txt"
    done
done

echo
python3 - "$W/rates.txt" <<'PY'
import statistics, sys
rates = {}
for line in open(sys.argv[1]):
    name, rps = line.split()
    rates.setdefault(name, []).append(float(rps.replace(",", "")))
base = statistics.median(rates["nginx-proxy"])
for name, runs in rates.items():
    m = statistics.median(runs)
    print(f"{name:<12} median {m:>9,.0f} req/s   {m / base:.2f} x nginx-proxy   runs "
          + " ".join(f"{r:,.0f}" for r in runs))
PY
echo "raw outputs: $W"
