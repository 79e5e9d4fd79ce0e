#!/usr/bin/env bash
# What a short GPU loan runs first (docs/gpu.md#a-short-loan): the decisive checks of tools/gpu_check.sh,
# then the rehearsal of fbt-1b's width through every entry point, each part bounded (7 and 6 minutes) so that
# both fit a 15-minute loan of one node; logs and reports under OUT (default runs/gpu-loan-DATE). On this 2-core
# CPU (no GPU: the GPU rows skipped) the whole script took 5 min 39 s, exit 0 (2026-12-06).
#
#   tools/gpu_loan.sh                      # python3 from PATH (inside the project's image)
#   PYTHON=/path/to/python OUT=/scratch/loan tools/gpu_loan.sh
# Exit code: gpu_check's (0 all that ran passed, 1 a check failed, 2 megatron-core missing), else the
# rehearsal's; 124 when a part ran out of its time.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-runs/gpu-loan-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
echo "=== $(date -u +%FT%TZ): $GPUS GPU(s); output in $OUT"

# 1. every check that can fail on what reading finds: imports, TE vs local (FP32/BF16/FP8, FP8 recompute),
#    the attention kernels at fbt-1b's heads and window, fbt-1b's speed and memory, offloading at 16K,
#    and with 2+ GPUs TP 2 + SP (Adam, NorMuon) and CP 2 against one GPU
timeout 420 env PYTHON="$PYTHON" tools/gpu_check.sh --perf-steps 3 --offload-seq-length 16384 --workdir "$OUT" \
    2>&1 | tee "$OUT/gpu_check.log"
check=${PIPESTATUS[0]}
echo "=== gpu_check: exit $check"

# 2. fbt-1b's width through training (k = 1, 3), checkpoint, resume, reshard and the export, 4 layers
timeout 360 "$PYTHON" tools/rehearse.py --recipe recipes/fbt_1b_100b.yaml --output "$OUT/rehearsal" --num-layers 4 \
    --nproc-per-node 1 --reshard-tp $((GPUS >= 2 ? 2 : 1)) --max-new-tokens 4 --no-vllm -- --bf16 true 2>&1 | tee "$OUT/rehearsal.log"
rehearsal=${PIPESTATUS[0]}
echo "=== rehearsal: exit $rehearsal"
exit $((check != 0 ? check : rehearsal))
