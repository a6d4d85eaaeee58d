#!/usr/bin/env bash
# The 32-layer step (pagedprefill-bench --layers 32) under two source trees of scripts/ab_trees.sh, in one device
# call, alternated A, B, A, B (one process each); the last B run adds FA3 and FA2 (a table of record):
#   AB="old new" bash scripts/ab_layers.sh          (carry .whl and _ab; logs, markdown and JSON Lines to $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
read -r A B <<<"${AB:-old new}"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
for round in 1 2; do
  for tree in "$A" "$B"; do
    be=${BACKENDS:-triton,cudnn}
    files=()
    if [ "$tree" = "$B" ] && [ "$round" = 2 ]; then  # (the device returns 8 files: the record's alone)
      be="$be,fa3-varlen,fa2-varlen"
      files=(--markdown "$OUT/layers.md" --out-json "$OUT/layers.jsonl")
    fi
    echo "## $tree $round ($be) $(date -u +%T)"
    PYTHONPATH=/tmp/site:$PWD/_ab/$tree/src timeout "${LAYERS_S:-240}" python3 -m pagedprefill.bench --layers 32 \
      --backends "$be" "${files[@]}" >"$OUT/layers-$tree-$round.log" 2>&1
    echo "rc $?"
    grep "^|" "$OUT/layers-$tree-$round.log" | head -40
  done
done
