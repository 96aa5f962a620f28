#!/usr/bin/env bash
# Batch-1 engine step under several XLA GPU flag sets, each in its own process (flags are read at
# backend start). Usage: bash bench/sweep_xla_flags.sh OUT_DIR [extra bench_engine.py args]
set -uo pipefail
out=${1:?output dir}; shift
declare -a names=(default no_triton_gemm cmdbuf_while no_cmdbuf)
declare -a flags=(
  ""
  "--xla_gpu_enable_triton_gemm=false"
  "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
  "--xla_gpu_enable_command_buffer="
)
for i in "${!names[@]}"; do
  echo "=== ${names[$i]}: XLA_FLAGS='${flags[$i]}'"
  XLA_FLAGS="${flags[$i]}" python3 bench/bench_engine.py --batches 1 --draft-batches "" --steps 16 --repeats 5 \
    --out "$out/sweep_${names[$i]}.json" "$@" 2>&1 | grep -E "^ +1 \||host overhead|Error|error" | grep -v Warning
done
