#!/usr/bin/env bash
# One check of a GPU machine (tools/gpu_check.py; its rows and their criteria: docs/gpu.md#the-rows-and-their-criteria):
# the environment gate; the Transformer Engine spec against the local spec (FP32 tight, BF16 by ratio to
# the local BF16 path's error); FP8 at current scaling (recompute on vs off tight; delayed at loss level);
# DDP's main_grad after k = 3 passes with gradient-accumulation fusion on vs off (N1); the attention
# kernels at fbt-1b's heads and window; fbt-1b's speed and memory against the planner; offloading at long
# context; with 2+ GPUs TP 2 + SP and CP 2 against one GPU; with --slurm-nodes, a 2-node job. Every row is
# PASS, FAIL (out of memory included), SKIP (why it could not run) or INFO; the last line says what was not
# checked. Exit code: 0 every row ran and passed, 1 a row failed, 3 none failed but some were not checked,
# 2 bad flags.
#
#   tools/gpu_check.sh                           # python3 from PATH (inside the project image, docs/gpu.md)
#   PYTHON=/path/to/python tools/gpu_check.sh --rows equivalence,fp8,kernels
#   FBT_PEAK_FLOPS=989e12 tools/gpu_check.sh     # peak BF16 FLOP/s for MFU on a GPU not in the table
# Options are tools/gpu_check.py's (--help).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
else
    echo "nvidia-smi: not found"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

exec "$PYTHON" tools/gpu_check.py "$@"
