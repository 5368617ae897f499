# Sourced by bench/run.sh, bench/profile.sh and bench/ab.sh: they measure
# fencegate on the same routes, so a profile or an A/B explains the numbers
# the benchmark gives; and profile.sh and ab.sh count CPU the same way.

# The [[routes]] of a measured fencegate, to the upstream on port $1.
fg_routes() { # upstream port
    cat <<ROUTES
[[routes]]
name = "documents"
path = "/docs/{id}"
upstream = "http://127.0.0.1:$1"
key = "doc:{id}"

# (h) and (i): the same resources, with an Idempotency-Key on every write.
[[routes]]
name = "keyed"
path = "/keyed/{id}"
upstream = "http://127.0.0.1:$1"
key = "doc:{id}"
idempotency = "required"
ROUTES
}

# Exits unless every tool named is on PATH: the caller's name, the tools.
require_tools() {
    local me=$1 tool
    shift
    for tool in "$@"; do
        command -v "$tool" >/dev/null 2>&1 || { echo "$me: $tool is not installed" >&2; exit 1; }
    done
}

# An nginx for a measurement: WORKDIR/NAME/nginx.conf with these http-level
# blocks (2 workers, no access log, keep-alive that never ends a run's
# connections). Start it with `nginx -p WORKDIR/NAME -c WORKDIR/NAME/nginx.conf`.
nginx_conf() { # workdir, name, blocks
    mkdir -p "$1/$2/logs"
    cat > "$1/$2/nginx.conf" <<EOF
worker_processes 2;
pid $1/$2/nginx.pid;
error_log $1/$2/logs/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    keepalive_requests 1000000;
    client_body_temp_path $1/$2/cb; proxy_temp_path $1/$2/p;
    fastcgi_temp_path $1/$2/f; uwsgi_temp_path $1/$2/u; scgi_temp_path $1/$2/s;
$3
}
EOF
}

# The upstream nginx (`return 200 "ok"`) on port $2, and the nginx reverse
# proxy to it on port $3 (keep-alive to the upstream), in WORKDIR $1:
# profile.sh's, ab.sh's and floor.sh's (run.sh has its own, with TLS).
nginx_upstream_conf() { # workdir, port
    nginx_conf "$1" up "server { listen 127.0.0.1:$2; location / { return 200 \"ok\"; } }"
}
nginx_proxy_conf() { # workdir, upstream port, port
    nginx_conf "$1" px "upstream backend { server 127.0.0.1:$2; keepalive 64; keepalive_requests 1000000; }
server { listen 127.0.0.1:$3; location / {
    proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection \"\"; } }"
}

# CPU clock ticks (user + system) of one process, from /proc; 0 for one
# that has ended.
own_ticks() { # pid
    local f
    read -r -a f < "/proc/$1/stat" 2>/dev/null || { echo 0; return; }
    echo $((f[13] + f[14]))
}

# CPU clock ticks of a process and its children (nginx's workers).
ticks() { # pid
    local t=0 p
    for p in $1 $(pgrep -P "$1" || true); do
        t=$((t + $(own_ticks "$p")))
    done
    echo "$t"
}

# What one process (and its children: nginx's workers) has used so far,
# summed over all their threads: "user-ticks system-ticks voluntary-switches
# involuntary-switches". A thread that waits for work (epoll_wait with
# nothing ready) switches voluntarily; one preempted, involuntarily.
proc_counts() { # pid
    local u=0 s=0 v=0 n=0 p t f k val
    for p in $1 $(pgrep -P "$1" || true); do
        for t in /proc/"$p"/task/*; do
            # A thread (or child) that ended while this looked is skipped.
            read -r -a f 2>/dev/null < "$t/stat" || continue
            u=$((u + f[13])) s=$((s + f[14]))
            while read -r k val; do
                case "$k" in
                    voluntary_ctxt_switches:) v=$((v + val)) ;;
                    nonvoluntary_ctxt_switches:) n=$((n + val)) ;;
                esac
            done 2>/dev/null < "$t/status" || true
        done
    done
    echo "$u $s $v $n"
}

# Busy clock ticks of the whole machine so far (every CPU: user, nice,
# system, irq, softirq), from /proc/stat. Not idle or iowait, and not steal:
# time the host gave to something else is no process's cost here.
machine_ticks() {
    awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 }' /proc/stat
}

# A new transaction id, taken for the asking: the difference of two, less
# one, is how many transactions wrote anywhere in the cluster in between.
xact_id() {
    psql -qAtX -d postgres -c "SELECT pg_current_xact_id()"
}

# Every Postgres server process now (the gateway's backends, and the WAL
# writer and checkpointer its commits make work), one "pid ticks" line
# each: what `pg_ticks_since` counts from.
pg_snapshot() {
    local p
    for p in $(pgrep -u postgres -x postgres || true); do
        echo "$p $(own_ticks "$p")"
    done
}

# Postgres's CPU ticks since the `pg_snapshot` in file $1: each server
# process now, less what it had then. A backend opened since (a batcher's
# new connection) counts whole; one that ended since is lost.
pg_ticks_since() { # snapshot file
    local total=0 p t
    local -A had=()
    while read -r p t; do had[$p]=$t; done < "$1"
    for p in $(pgrep -u postgres -x postgres || true); do
        t=$(own_ticks "$p")
        total=$((total + t - ${had[$p]:-0}))
    done
    echo "$total"
}

# Linux's autogroup gives each session a scheduling group of its own, and
# shares the CPUs between groups, not processes. A benchmark's load
# generator, nginx and fencegate run in the script's session; Postgres
# runs in the session that started it. Measured on a 2-core machine (kernel
# 6.18) under fencegate's GET load: Postgres backends waited up to 1.6 s
# for a CPU (`perf sched latency`), a psql round trip took up to 1.9 s
# (93 ms at most with autogroup off), and the gateway's single-writer lock
# check went unanswered for 2 s. A run with Postgres starved that way
# measures the scheduler. So the scripts turn autogroup off for their run
# (with root; otherwise they say it stays on) and put it back at exit.
AUTOGROUP=/proc/sys/kernel/sched_autogroup_enabled
AUTOGROUP_WAS=""
autogroup_off() { # prints what the run had: "off", "off (turned off for the run)" or "on"
    if [ ! -r "$AUTOGROUP" ] || [ "$(cat "$AUTOGROUP")" = 0 ]; then
        echo "off"
    elif echo 0 2>/dev/null > "$AUTOGROUP"; then
        AUTOGROUP_WAS=1
        echo "off (turned off for the run)"
    else
        echo "on (could not be turned off: not root)"
    fi
}
# autogroup_off, with what the run had written to FILE and said.
autogroup_note() { # file
    autogroup_off > "$1"
    echo "autogroup: $(cat "$1")"
}
autogroup_restore() {
    if [ -n "$AUTOGROUP_WAS" ]; then
        echo "$AUTOGROUP_WAS" > "$AUTOGROUP" 2>/dev/null || true
        AUTOGROUP_WAS=""
    fi
}
