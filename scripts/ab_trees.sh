#!/usr/bin/env bash
# Source trees to time against each other in one device call (the device gets the working tree, not git):
#   bash scripts/ab_trees.sh NAME=REV [NAME=REV ...]   e.g. base=main poly=exp/f8-fma-exp2
# writes _ab/NAME/src and _ab/NAME/tests from `git archive REV src tests` (src after an optional sed: NAME=REV:SED,
# e.g. half=exp/f8-fma-exp2:'s/FMA_SPLIT: gl.constexpr = gl.constexpr(0)/FMA_SPLIT: gl.constexpr = gl.constexpr(1)/').
# _ab/ is kept out of git (.git/info/exclude); name it in the device call's carry. Then:
#   AB="base half" TUNE_ARGS="fp8_b2_q8k" bash scripts/gpu_session.sh ab
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/_ab/' .git/info/exclude || echo '/_ab/' >> .git/info/exclude
rm -rf _ab
for spec in "$@"; do
  name=${spec%%=*}; rest=${spec#*=}; rev=${rest%%:*}; sed_expr=""
  [[ $rest == *:* ]] && sed_expr=${rest#*:}
  mkdir -p "_ab/$name"
  git archive "$rev" src tests | tar -x -C "_ab/$name"
  if [[ -n $sed_expr ]]; then
    grep -rl --include=*.py . "_ab/$name/src" | xargs sed -i "$sed_expr"
  fi
  echo "_ab/$name: $rev ${sed_expr:+(sed $sed_expr)}"
done
du -sh _ab
