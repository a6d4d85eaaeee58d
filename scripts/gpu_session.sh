#!/usr/bin/env bash
# One device call: install, GPU tests, smoke checks, benchmark. Logs go to $OUT.
# Usage (on the GPU machine, from the repo root): bash scripts/gpu_session.sh [steps...]
# steps: install tests sharded smoke bench graph serving overhead timeline profile gluon pending probe diag
# (default: tests smoke bench). sharded: every GPU test in $SHARDS parallel pytest processes.
# Extra pytest args via PYTEST_ARGS, bench args via BENCH_ARGS.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || cat "$OUT/install.log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "import cudnn; print('cudnn-frontend', cudnn.__version__, 'cudnn', cudnn.backend_version())" 2>&1 | tail -1
steps=${*:-tests smoke bench}
for s in $steps; do
  echo "=== $s $(date +%T)"
  case $s in
    tests) timeout 420 python3 -m pytest -q -x -m gpu ${PYTEST_ARGS:-} tests 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    sharded) bash scripts/gpu_tests_sharded.sh ${SHARD_IDS:-} 2>&1 | tee "$OUT/sharded-tests.log" | tail -30 ;;
    smoke) timeout 200 python3 scripts/cudnn_smoke.py 2>&1 | tee "$OUT/smoke.log" | tail -40 ;;
    bench) timeout 500 python3 -m pagedprefill.bench ${BENCH_ARGS:-} --out-json "$OUT/h200.json" --plot "$OUT/h200.png" --markdown "$OUT/table.md" 2>&1 | tee "$OUT/bench.log" | tail -30 ;;
    graph) timeout 300 python3 -m pagedprefill.bench --cuda-graph --backends cudnn,triton --out-json "$OUT/h200-graph.json" 2>&1 | tee "$OUT/bench-graph.log" | tail -16 ;;
    serving) timeout 300 python3 -m pagedprefill.bench --serving ${SERVING_N:-1000} --out-json "$OUT/h200-serving.json" 2>&1 | tee "$OUT/serving.log" | tail -8 ;;
    overhead) timeout 200 python3 -m pagedprefill.bench --overhead --out-json "$OUT/h200-overhead.json" 2>&1 | tee "$OUT/overhead.log" | tail -12
              timeout 200 python3 -m pagedprefill.bench --overhead --cuda-graph --out-json "$OUT/h200-overhead.json" 2>&1 | tee "$OUT/overhead-graph.log" | tail -12 ;;
    timeline) timeout 150 python3 scripts/overhead_timeline.py 2>&1 | grep -v -i warn | tee "$OUT/timeline.log" ;;
    gluon) timeout 420 python3 -m pytest -q -x -m gpu tests/test_gluon_sm90.py 2>&1 | tee "$OUT/gluon-tests.log" | tail -5 ;;
    pending)  # the GPU tests not yet completed on the current default kernel (scripts/gpu_pending.txt)
           grep -v '^#' scripts/gpu_pending.txt >/tmp/pending_ids.txt
           SHARDS=${SHARDS:-1} SHARD_S=${PENDING_S:-420} bash scripts/gpu_tests_sharded.sh /tmp/pending_ids.txt 2>&1 \
             | tee "$OUT/pending-tests.log" | tail -40 ;;
    probe) W=${PROBE_W:-llama8b_b1_q16k,llama8b_b4_q4k,llama8b_b16_q1k,page64_b16_q1k,mla192_b4_q4k,chunked_b8_q512_p7680,llama70b_b8_q2k,varlen_b32}
           # beside cuDNN: the shape rule, and on top of it tile_fence=0 (no proxy fence after TMA tiles;
           # level at 23:20 UTC); earlier probes with their configs: bench/results/h200-probe-2026-11-*.log
           timeout ${PROBE_S:-400} python3 scripts/tune_triton.py --graph --workloads $W \
             --configs "${PROBE_CONFIGS:-gluon=1;gluon=1,g.rule=1,g.tile_fence=0}" \
             2>&1 | grep -A80 SUMMARY | tee "$OUT/gluon-probe.log" ;;
    diag)  # per-item costs of the Gluon kernel: no Q copies (8), no O/LSE stores (16), neither (24); wrong results
           W=llama8b_b16_q1k,page64_b16_q1k,llama70b_b8_q2k,llama8b_b4_q4k,llama8b_b1_q16k,mla192_b4_q4k
           for d in 0 8 16 24; do
             timeout 150 python3 scripts/tune_triton.py --graph --gluon-diag $d --workloads $W --configs "gluon=1" \
               2>&1 | grep -A14 SUMMARY | sed "s/^/diag=$d /" | tee -a "$OUT/gluon-diag.log"
           done ;;
    profile) timeout 120 python3 scripts/host_profile.py llama8b_b16_q1k cudnn triton 2>&1 | tee "$OUT/profile.log" | grep -A6 "host us" ;;
    install) ;;  # (the install above only; then export PYTHONPATH=/tmp/site:$PYTHONPATH to import cudnn)
    *) echo "unknown step $s" ;;
  esac
done
