#!/usr/bin/env bash
# The GPU tests in N parallel pytest processes on one GPU (kernel compiles are CPU-bound, so a
# 16-core device machine runs the suite about N times faster). Logs per shard and a summary in $OUT.
# Usage: SHARDS=12 SHARD_S=400 bash scripts/gpu_tests_sharded.sh [pytest selection args...]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/shards"
N=${SHARDS:-12}
sel=("${@:-tests}")
python3 -m pytest -q --co -m gpu "${sel[@]}" 2>/dev/null | grep '::' >"$OUT/shards/ids.txt"
echo "$(wc -l <"$OUT/shards/ids.txt") GPU tests in $N shards, $(date +%T)"
# round robin, so each parametrised grid spreads over the shards
awk -v n="$N" -v d="$OUT/shards" '{ print > (d "/ids." (NR - 1) % n) }' "$OUT/shards/ids.txt"
pids=()
for f in "$OUT"/shards/ids.*[0-9]; do
  i=${f##*.}
  (timeout "${SHARD_S:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider $(cat "$f") \
     >"$OUT/shards/log.$i" 2>&1; echo "rc=$?" >>"$OUT/shards/log.$i") &
  pids+=($!)
done
wait "${pids[@]}"
echo "=== done $(date +%T)"
for f in "$OUT"/shards/log.*; do echo "${f##*/}: $(tail -2 "$f" | tr '\n' ' ')"; done
grep -h -E '^(FAILED|ERROR)' "$OUT"/shards/log.* | sort | uniq | head -40
