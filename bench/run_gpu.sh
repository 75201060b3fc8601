#!/usr/bin/env bash
# Run every GPU benchmark, then the CPU overhead benchmark, one after another.
# JSON goes to ${FERRY_BENCH_OUT:-bench/results}; a failing script does not stop the rest:
# the failures are listed at the end and the exit status is non-zero if there were any.
# Extra arguments (e.g. --smoke) go to the GPU scripts. PYTHON picks the interpreter (default python3).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export FERRY_BENCH_OUT="${FERRY_BENCH_OUT:-bench/results}"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"

failed=()
run() {
  echo
  echo "=== $* ($(date -u +%H:%M:%S))"
  local start=$SECONDS
  if "$PY" "$@"; then
    echo "=== ok: $1 ($((SECONDS - start)) s)"
  else
    echo "=== FAILED (exit $?): $1 ($((SECONDS - start)) s)"
    failed+=("$1")
  fi
}

for script in copy_throughput cuda_graphs cpu_fallback inductor_fallback device_memory dynamic pipeline distributed gemm_kernels conv_gemm fp32_gemm_floor; do
  run "bench/$script.py" "$@"
done
# every model and batch in a process of its own: a CUDA fault or a cold compile costs its rows only
run bench/models.py --isolate 300 --runners eager,compile,compile-ro,ferry,ferry-graphs,ferry-inductor,ferry-inductor-graphs "$@"
# generation: bf16 decode and prefill; int4 weights (torchao); a Whisper-small-shaped speech model
run bench/llm.py --models llama-1b --batch 1 --cache 1024 --prompt 512
run bench/llm.py --quant int4 --models llama-1b --batch 1 --cache 1024 --prompt 1 --out llm_int4
run bench/speech.py
run bench/cpu_overhead.py

echo
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}"
  exit 1
fi
echo "all benchmarks finished; JSON in $FERRY_BENCH_OUT"
