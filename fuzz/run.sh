#!/usr/bin/env bash
# The differential tests of the HTTP/1.1 framing (tests/it/differential.rs),
# run longer than CI runs them: the gateway's request framing against
# hyper's server, and its answer framing against hyper's client, on
# generated and mutated byte streams.
#
#   bash fuzz/run.sh [CASES [SEED]]
#
# CASES a side (default 100000; CI runs the test's own CASES), SEED for
# proptest's generator (default: from the clock, printed, so that a run
# can be repeated). A debug build, as CI's: the parsers are the same, and
# it needs no release build. At the end each side prints how many cases
# agreed, and how many differed only where the gateway is stricter on
# purpose, by reason; a disagreement of any other shape fails the run and
# prints the smallest stream proptest shrank it to.
set -euo pipefail
cd "$(dirname "$0")/.."
cases=${1:-100000}
seed=${2:-$(date +%s)}
echo "differential: $cases cases a side, seed $seed"
PROPTEST_CASES=$cases PROPTEST_RNG_SEED=$seed \
    cargo test --test it differential:: -- --nocapture --test-threads 2
