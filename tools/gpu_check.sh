#!/usr/bin/env bash
# One short check of a GPU machine (about 10 minutes on an H100/H200): environment; Transformer Engine
# spec vs local spec with the same weights (FP32 with TF32 off, BF16, FP8; k = 1, 2, 3); fbt-1b tokens/s,
# MFU and peak memory (and the planner's estimate of it); at 32K, k = 3, recompute inputs kept vs offloaded (ours, and DeepSpeed's
# cpu_checkpointing when installed); the attention kernels at fbt-1b's heads and window; FP8 with pass recompute;
# with 2+ GPUs, TP=2 + SP (Adam, NorMuon) and CP=2 (BF16) vs 1 GPU through the training entry point; with
# --slurm-nodes 2, a 2-node job through slurm/train.sbatch stopped by the time-limit signal. Ends with a
# PASS/FAIL table. Without Transformer Engine the local spec runs (BF16 vs FP32; the TE and FP8 checks
# skipped, one line each); without a GPU the GPU sections are skipped, one line each, and the rest runs
# on the CPU. Exit code: 0 all that ran passed, 1 a check failed, 2 megatron-core missing.
#
#   tools/gpu_check.sh                           # python3 from PATH (inside the project image, docs/gpu.md)
#   PYTHON=/path/to/python tools/gpu_check.sh --skip-perf --perf-seq-length 8192
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

# Transformer Engine runs FP32 GEMMs in TF32 regardless of torch's flags; with this cuBLAS uses full
# FP32, so the FP32 TE-vs-local comparison is exact up to summation order (BF16/FP8 are unaffected).
export NVIDIA_TF32_OVERRIDE="${NVIDIA_TF32_OVERRIDE:-0}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

exec "$PYTHON" tools/gpu_check.py "$@"
