#!/usr/bin/env bash
# The multi-process tests N times in a row with two busy processes beside them (issue 15: a test
# that fails one run in ten under load is a failing test). Each run's log goes to OUT_DIR; the
# last line per run says its exit status, duration and pytest's summary. Exit status: the number
# of failed runs (0: none).
#
#   tools/soak.sh [N=10] [OUT_DIR=soak-logs] [pytest arguments...]   (default: -m slow)
set -u
n=${1:-10}
out=${2:-soak-logs}
shift $(($# < 2 ? $# : 2))
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(-m slow)
case $n in '' | *[!0-9]* | 0)
    echo "error: N=$n: the number of runs must be a positive integer" >&2
    exit 2
    ;;
esac
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)  # absolute: the runs start in the repository root
cd "$(dirname "$0")/.." || exit 2

# What the runs test: the commit, and a fingerprint of the code and tests alone, so that runs of
# commits that differ only in docs count as runs of the same code.
tested=(hybrid2d tests recipes tools pyproject.toml)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
code=$(git rev-parse "${tested[@]/#/HEAD:}" 2>/dev/null | git hash-object --stdin 2>/dev/null | cut -c1-12)
git diff --quiet HEAD -- "${tested[@]}" 2>/dev/null || code="$code+uncommitted"
echo "soak at commit $commit, code $code, $(date -u '+%Y-%m-%d %H:%M UTC')"

busy=()
for _ in 1 2; do
    python -c "while True: pass" &
    busy+=($!)
done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT

failed=0
for run in $(seq 1 "$n"); do
    start=$(date +%s)
    python -m pytest -q -p no:cacheprovider "${args[@]}" >"$out/run-$run.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && failed=$((failed + 1))
    echo "run $run/$n (code $code): exit $rc, $(($(date +%s) - start)) s, $(tail -n 1 "$out/run-$run.log")"
done
echo "$failed of $n runs failed (two busy processes beside them; logs in $out)"
exit "$failed"
