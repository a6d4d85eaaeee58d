#!/usr/bin/env bash
# GPU tests in N parallel pytest processes on one GPU (kernel compiles are CPU-bound). Each shard
# takes a contiguous block of the list, so the kernels a parametrised grid compiles stay in one
# process's cache, and nproc / N CPU threads (2026-11-29, 10-14 shards with torch's default threads
# each: every test 10-25x slower than alone). Prints one log (gpu_session.sh: $OUT/sharded-tests.log).
# Usage: SHARDS=4 SHARD_S=400 bash scripts/gpu_tests_sharded.sh [file of test ids | pytest args...]
set -uo pipefail
tmp=$(mktemp -d)
N=${SHARDS:-4}
threads=$(( $(nproc) / N )); export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
if [ -f "${1:-}" ]; then cp "$1" "$tmp/ids"
else python3 -m pytest -q --co -m gpu "${@:-tests}" 2>/dev/null | grep '::' >"$tmp/ids"; fi
echo "$(wc -l <"$tmp/ids") GPU tests in $N shards, $(date +%T)"
if [ ! -s "$tmp/ids" ]; then echo "no tests to run"; rm -rf "$tmp"; exit 0; fi  # (else pytest would run them all)
split -e -n "l/$N" -d "$tmp/ids" "$tmp/ids."  # (-e: no empty shard, which would run every test)
pids=()
for f in "$tmp"/ids.[0-9]*; do
  (timeout "${SHARD_S:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE $(cat "$f") \
     >"$f.log" 2>&1; printf '\nrc=%s\n' $? >>"$f.log") &
  pids+=($!)
done
wait "${pids[@]}"
echo "=== done $(date +%T)"
for f in "$tmp"/ids.[0-9]*; do
  [ "${f%.log}" = "$f" ] || continue
  echo "--- shard ${f##*.}: $(wc -l <"$f") tests, first $(head -1 "$f")"
  tail -3 "$f.log"
  # (with -q, one character per test in list order: the ids that passed)
  n=$(grep -E '^[.FEsx]+( +\[ *[0-9]+%\])?$' "$f.log" | grep -o -E '^[.FEsx]+' | tr -d '\n' | wc -c)
  echo "completed $n: $(head -n "$n" "$f" | tail -1)"
  grep -q '^rc=124' "$f.log" && echo "stopped at the timeout in: $(sed -n "$((n + 1))p" "$f")"
done
grep -h -E '^(FAILED|ERROR)' "$tmp"/ids.*.log | sort -u
rm -rf "$tmp"
exit 0
