#!/usr/bin/env bash
# Model FLOPs utilisation of a 1.06B-parameter dense T5.1.1 and a 1.9B-parameter
# (0.3B active) Mixture-of-Experts T5.1.1 in bfloat16 on one GPU, with the
# report of `make bench` (MFU against the measured matmul peak, framework
# overhead, input pipeline). Takes under five minutes on one H100/H200.
#
#   make install && benchmarks/gpu.sh
#
# `make install` gives the CPU build of jaxlib; the first run adds jax's CUDA
# 12 plugin of the same version to the virtualenv (needs the network once).
# GPU_BENCH_ARGS adds arguments to benchmarks/run.py, e.g. a compile-time
# sweep: GPU_BENCH_ARGS="--compile_depths=2,4,8" benchmarks/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-.venv}/bin"

backend() {
  JAX_PLATFORMS= "$BIN/python" -c 'import jax; print(jax.default_backend())' 2>/dev/null || true
}

if [[ "$(backend)" != "gpu" ]]; then
  version="$("$BIN/python" -c 'import jax; print(jax.__version__)')"
  echo "No GPU visible to jax $version; installing jax[cuda12]==$version" >&2
  "$BIN/python" -m pip install --quiet "jax[cuda12]==$version"
  if [[ "$(backend)" != "gpu" ]]; then
    echo "jax still sees no GPU (nvidia-smi below); check the driver and CUDA 12." >&2
    nvidia-smi >&2 || true
    exit 1
  fi
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# One process owns the GPU; most of its memory goes to the model.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
# train() then reuses the bare loop's compiled step instead of compiling again.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$(mktemp -d)}"

# Bigger matmuls for the peak: a GPU needs them to get near its datasheet rate.
# No compile sweep or memory run by default: each costs a further compile.
start=$SECONDS
"$BIN/python" benchmarks/run.py \
  --gin_file=gin/benchmarks/gpu_dense_1b.gin --gin_file=gin/benchmarks/gpu_moe.gin \
  --steps=30 --stats=10 --bare_steps=5 --pipeline_batches=50 \
  --matmul_sizes=4096,8192 --compile_depths= --memory_steps=0 ${GPU_BENCH_ARGS:-}
echo "benchmarks/gpu.sh took $((SECONDS - start)) s"
