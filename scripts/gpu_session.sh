#!/usr/bin/env bash
# One device call: install, then the given steps in order; every log goes to $OUT.
#   bash scripts/gpu_session.sh [steps...]        (default: tests memcheck)
# steps:
#   tests     every GPU test (pytest -m gpu), in parallel processes when pytest-xdist is importable; a run stopped
#             by TEST_S names the tests it left running (scripts/pytest_log.py: a test that started long before the
#             limit and never finished is a hang)
#   memcheck  scripts/memcheck_cases.py under compute-sanitizer memcheck, caching allocator off; CUDA API
#             return codes are not reported (cuda-python probes driver symbols with cuGetProcAddress,
#             and each probe of an absent one would count as an "error"): memory accesses only
#   bench     pagedprefill-bench, eager, every workload x backend (JSON Lines, markdown; plot from the JSON elsewhere)
#   graph     the same with each call captured in a CUDA graph
#   layers    a serving engine's eager step of 32 layers (plan once, run per layer)
#   serving   a 10,000-call serving loop per backend: latency, builds, device memory growth
#   variants  scripts/bench_variants.py: window, soft-cap, sinks, merge_state
#   tune      scripts/tune_hopper.py \$TUNE_ARGS: the Hopper kernel under knob sets beside cuDNN
#   profile   scripts/host_profile.py: cProfile of plan.run / one-shot per layer, and primitive costs
#   ncu       Nsight Compute on scripts/ncu_case.py \$NCU_CASES (default: the Triton kernel on llama8b_b4_q4k, then FA3
#             on it): speed of light, compute and memory workload sections, plus the shared-memory bank and GMMA-pipe
#             metrics of \$NCU_METRICS that this ncu knows (the others are named in the log and left out); \$NCU_SECTIONS
#             replaces the three sections (e.g. "SpeedOfLight WarpStateStats SchedulerStats" for stall reasons);
#             NCU_SASS=1 also writes the kernels' per-SASS-instruction CSV (\$TAG-sass.csv.gz) and its summary
#   clock     scripts/clock_probe.py \$CLOCK_ARGS: SM clock, board power and cycles per call of each system under
#             sustained calls
#   ab        scripts/tune_hopper.py \$TUNE_ARGS under each source tree _ab/NAME of \$AB (scripts/ab_trees.sh;
#             carry _ab), in the order given and then reversed, one process per tree and pass
# Knobs: SRC (the package's source tree, default src; e.g. _ab/NAME/src), TESTS (test paths/ids, default tests),
# PYTEST_ARGS, WORKERS, BENCH_ARGS, PROFILE_ARGS, SERVING_N, NCU_CASES, NCU_METRICS, NCU_SECTIONS, NCU_SASS, CLOCK_ARGS, TAG (file prefix);
# time limits in seconds: TEST_S, MEMCHECK_S, BENCH_S, SERVING_S, VARIANTS_S, TUNE_S, NCU_S, CLOCK_S.
# Wheels (.whl/, carried): nvidia-cudnn-frontend, fa3-fwd, pytest-xdist + execnet.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
TAG=${TAG:-h200}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/tmp/install.log 2>&1 || tail -5 /tmp/install.log
export PYTHONPATH=/tmp/site:${SRC:-$PWD/src}:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 - <<'EOF'
import torch, triton
print("torch", torch.__version__, "| triton", triton.__version__, "|", torch.cuda.get_device_name())
try:
    import cudnn
    print("cudnn-frontend", cudnn.__version__, "| cudnn", cudnn.backend_version())
except Exception as e:
    print("cudnn-frontend not importable:", e)
try:
    import fa3_fwd_interface  # noqa: F401
    print("fa3_fwd_interface importable")
except Exception as e:
    print("fa3 not importable:", e)
EOF
steps=${*:-tests memcheck}
for s in $steps; do
  echo "=== $s $(date -u +%T)"
  case $s in
    tests)
      par=""
      python3 -c "import xdist" 2>/dev/null && par="-n ${WORKERS:-8}"
      # (-v: each result is logged as it lands, so a run stopped by its time limit still names its failures)
      timeout "${TEST_S:-420}" python3 -m pytest -v -rfE -m gpu $par -p no:cacheprovider ${PYTEST_ARGS:-} ${TESTS:-tests} \
        >"$OUT/$TAG-tests.log" 2>&1
      echo "rc $?"
      grep -E "FAILED|ERROR" "$OUT/$TAG-tests.log" | grep -v "^tests/" | head -40
      tail -3 "$OUT/$TAG-tests.log"
      # (a run stopped by its time limit prints no summary: name the tests it left running, where a hang shows)
      python3 scripts/pytest_log.py "$OUT/$TAG-tests.log" | head -20 ;;
    memcheck)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${MEMCHECK_S:-300}" compute-sanitizer --tool memcheck \
        --report-api-errors no --leak-check no --print-limit 50 python3 scripts/memcheck_cases.py >"$OUT/$TAG-memcheck.log" 2>&1
      echo "rc $?"
      grep -vE "^\s*$" "$OUT/$TAG-memcheck.log" | tail -22 ;;
    bench)
      timeout "${BENCH_S:-400}" python3 -m pagedprefill.bench ${BENCH_ARGS:-} --out-json "$OUT/$TAG-eager.jsonl" \
        --markdown "$OUT/$TAG-eager.md" >"$OUT/$TAG-eager.log" 2>&1
      echo "rc $?"
      cat "$OUT/$TAG-eager.md" 2>/dev/null || tail -20 "$OUT/$TAG-eager.log" ;;
    graph)
      timeout "${BENCH_S:-400}" python3 -m pagedprefill.bench --cuda-graph ${BENCH_ARGS:-} --out-json "$OUT/$TAG-graph.jsonl" \
        --markdown "$OUT/$TAG-graph.md" >"$OUT/$TAG-graph.log" 2>&1
      echo "rc $?"
      cat "$OUT/$TAG-graph.md" 2>/dev/null || tail -20 "$OUT/$TAG-graph.log" ;;
    layers)
      timeout 300 python3 -m pagedprefill.bench --layers 32 --out-json "$OUT/$TAG-layers.jsonl" \
        --markdown "$OUT/$TAG-layers.md" >"$OUT/$TAG-layers.log" 2>&1
      echo "rc $?"
      cat "$OUT/$TAG-layers.md" 2>/dev/null || tail -20 "$OUT/$TAG-layers.log" ;;
    serving)
      timeout "${SERVING_S:-400}" python3 -m pagedprefill.bench --serving "${SERVING_N:-10000}" --serving-backends cudnn,triton,auto \
        --out-json "$OUT/$TAG-serving.jsonl" --markdown "$OUT/$TAG-serving.md" >"$OUT/$TAG-serving.log" 2>&1
      echo "rc $?"
      cat "$OUT/$TAG-serving.md" 2>/dev/null || tail -20 "$OUT/$TAG-serving.log" ;;
    variants)
      timeout "${VARIANTS_S:-300}" python3 scripts/bench_variants.py --out "$OUT/$TAG-variants.md" >"$OUT/$TAG-variants.log" 2>&1
      echo "rc $?"
      cat "$OUT/$TAG-variants.md" 2>/dev/null || tail -20 "$OUT/$TAG-variants.log" ;;
    tune)
      timeout "${TUNE_S:-240}" python3 scripts/tune_hopper.py ${TUNE_ARGS:-d256_b8_q2k} >"$OUT/$TAG-tune.log" 2>&1
      echo "rc $?"
      cat "$OUT/$TAG-tune.log" ;;
    ncu)
      want=${NCU_METRICS:-l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active}
      known=$(ncu --query-metrics 2>/dev/null | awk '{print $1}')
      have=""
      for m in ${want//,/ }; do
        if grep -qx "${m%%.*}" <<<"$known"; then have="$have,$m"; else echo "ncu does not know $m: left out"; fi
      done
      secs=""
      for x in ${NCU_SECTIONS:-SpeedOfLight ComputeWorkloadAnalysis MemoryWorkloadAnalysis_Tables}; do secs="$secs --section $x"; done
      timeout "${NCU_S:-400}" ncu --profile-from-start off --clock-control none $secs ${have:+--metrics ${have#,}} \
        python3 scripts/ncu_case.py ${NCU_CASES:-llama8b_b4_q4k fa3/llama8b_b4_q4k} >"$OUT/$TAG-ncu.log" 2>&1
      echo "rc $?"
      grep -E "attention_kernel|flash|Shared|bank|gmma|Throughput|Duration|Pipe|stalled|issue|Eligible|Warp Cycles" "$OUT/$TAG-ncu.log" | head -150
      if [ -n "${NCU_SASS:-}" ]; then  # per-SASS-instruction counts and stall samples of the attention kernels
        timeout "${NCU_S:-400}" ncu --profile-from-start off --clock-control none \
          --kernel-name regex:"attention_kernel|device_kernel" --section SourceCounters --section WarpStateStats \
          -o /tmp/ncu-src -f python3 scripts/ncu_case.py ${NCU_CASES:-llama8b_b4_q4k fa3/llama8b_b4_q4k} \
          >"$OUT/$TAG-ncu-src.log" 2>&1
        ncu -i /tmp/ncu-src.ncu-rep --page source --csv --print-source sass >/tmp/ncu-sass.csv 2>>"$OUT/$TAG-ncu-src.log"
        python3 scripts/ncu_sass_summary.py /tmp/ncu-sass.csv
        gzip -c /tmp/ncu-sass.csv >"$OUT/$TAG-sass.csv.gz"
      fi ;;
    ab)
      order="${AB:?AB: names of _ab/ trees}"
      rev=$(echo $order | tr ' ' '\n' | tac | tr '\n' ' ')
      for t in $order $rev; do
        echo "## $t"
        PYTHONPATH=/tmp/site:$PWD/_ab/$t/src timeout "${TUNE_S:-240}" python3 scripts/tune_hopper.py ${TUNE_ARGS:-d256_b8_q2k} 2>&1 | grep -E "triton|ERROR"
      done | tee "$OUT/$TAG-ab.log" ;;
    clock)
      timeout "${CLOCK_S:-240}" python3 scripts/clock_probe.py ${CLOCK_ARGS:-llama8b_b1_q16k fp8_b2_q8k} >"$OUT/$TAG-clock.log" 2>&1
      echo "rc $?"
      cat "$OUT/$TAG-clock.log" ;;
    profile)
      timeout 240 python3 scripts/host_profile.py --out "$OUT" ${PROFILE_ARGS:-} >"$OUT/$TAG-profile.log" 2>&1
      echo "rc $?"
      cat "$OUT/$TAG-profile.log" ;;
    *) echo "unknown step $s" ;;
  esac
done
echo "=== done $(date -u +%T)"
# the essentials last, where a truncated output keeps them
echo "=== summary"
[ -f "$OUT/$TAG-tests.log" ] && echo "tests: $(grep -E "[0-9]+ (passed|failed)" "$OUT/$TAG-tests.log" | tail -1 || true)" \
  "$(grep -q -E "[0-9]+ (passed|failed)" "$OUT/$TAG-tests.log" || echo "(no pytest summary: stopped by TEST_S;" \
  "$(python3 scripts/pytest_log.py "$OUT/$TAG-tests.log" | grep -c "no outcome") tests left running)")"
[ -f "$OUT/$TAG-memcheck.log" ] && echo "memcheck: $(grep "ERROR SUMMARY" "$OUT/$TAG-memcheck.log" | tail -1)"
for k in eager graph layers; do
  [ -f "$OUT/$TAG-$k.md" ] && grep "^| geomean" "$OUT/$TAG-$k.md" | sed "s/^/$k: /"
done
true
