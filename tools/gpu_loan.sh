#!/usr/bin/env bash
# What a 15-minute loan of one GPU runs (docs/gpu.md#a-short-loan): the rows that decide, each part its own
# process under its own time bound, then one report. The bounds (seconds, x LOAN_TIME_SCALE):
#   gate 30 | equivalence + fp8 75 | main_grad 60 | kernels 60 | performance 60 | offload 60 | rehearsal 180
# 525 s in all (8 min 45 s) at most, plus the summary: a 15-minute loan keeps 3-4 minutes for the machine's
# start and slack. The gate comes first: with a GPU required, a FAIL there (no GPU, no Transformer Engine,
# no megatron-core, a kernel that does not run) stops the loan before it spends its minutes. A part that
# runs out of its bound is a FAIL row, a part not run a SKIP row. With 2+ GPUs a multi_gpu part (240 s)
# runs too (not within 10 minutes then). Every part runs with TF32 off; TE's attention is deterministic
# where rows compare closely (gpu_check's equivalence, fp8 and main_grad groups, every rehearsal stage).
#
#   tools/gpu_loan.sh              # inside the project's image on the lent GPU (python3 from PATH)
#   ON_CPU=1 tools/gpu_loan.sh     # the same on a machine without one: the gate's GPU rows SKIP instead of
#                                  # stopping it, bounds x 8 (LOAN_TIME_SCALE: a shared CPU), main_grad also against the TE double
#   PYTHON=/path/to/python OUT=/scratch/loan WORK=/scratch/loan-work tools/gpu_loan.sh
# OUT (default runs/gpu-loan-DATE): the logs, each part's report, parts.tsv and loan.json; WORK (default
# OUT): the rehearsal's checkpoints and exports (about 17 GB at its 4 layers, measured on CPU: where OUT is
# copied back from a lent machine, set WORK outside it). The rehearsal prepares data/stdlib-sp2048 (23 MiB) when it is missing: bring it prepared.
# Exit code: the loan report's (0 every row ran and passed, 1 a row failed, 3 none failed but some were not
# checked); 1 with one line when the gate could not even write its report.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
ON_CPU="${ON_CPU:-0}"
SCALE="${LOAN_TIME_SCALE:-$((ON_CPU ? 8 : 1))}"
OUT="${OUT:-runs/gpu-loan-$(date -u +%Y%m%dT%H%M%SZ)}"
WORK="${WORK:-$OUT}"
mkdir -p "$OUT" "$WORK"
# TF32 off before any CUDA library starts (NGC sets TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1); attention's determinism
# is left to the parts (measure.EXACT_ENV), so the kernel rows see the backend training runs
export NVIDIA_TF32_OVERRIDE=0 TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0 CUBLAS_WORKSPACE_CONFIG=:4096:8 \
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
: > "$OUT/parts.tsv"
echo "=== $(date -u +%FT%TZ): ${GPUS:-0} GPU(s); bounds x $SCALE; logs and reports in $OUT"

part() {  # part NAME BOUND REPORT COMMAND...: run it under its bound, its output to NAME.log, one line in parts.tsv
    local name=$1 bound=$(($2 * SCALE)) report=$3 start=$SECONDS code
    shift 3
    timeout --kill-after=5 "$bound" "$@" > "$OUT/$name.log" 2>&1
    code=$?
    printf '%s\t%s\t%s\t%s\t%s\t\n' "$name" "$code" "$((SECONDS - start))" "$bound" "$report" >> "$OUT/parts.tsv"
    echo "=== $(date -u +%T) $name: exit $code after $((SECONDS - start)) s of its $bound s ($OUT/$name.log)"
    return "$code"
}
check() {  # check NAME BOUND ROWS...: a part of tools/gpu_check.py
    local name=$1 bound=$2
    shift 2
    part "$name" "$bound" "$OUT/$name.json" "$PYTHON" tools/gpu_check.py --json "$OUT/$name.json" --workdir "$WORK" "$@"
}
not_run() { printf '%s\t-\t0\t0\t-\t%s\n' "$1" "$2" >> "$OUT/parts.tsv"; }

REQUIRE=(--require-gpu)
((ON_CPU)) && REQUIRE=()
check gate 30 --rows gate "${REQUIRE[@]}"
gate=$?
if ((gate != 0 && gate != 3)); then
    echo "=== the environment gate failed (exit $gate): the loan stops here"
    if [[ ! -f "$OUT/gate.json" ]]; then  # it could not even write its report (no torch, a bound too short)
        echo "the gate's last line: $(tail -n 1 "$OUT/gate.log")"
        exit 1
    fi
    grep -E 'FAIL$' "$OUT/gate.log"
    for name in equivalence main_grad kernels performance offload rehearsal; do
        not_run "$name" "the environment gate failed"
    done
else
    # the rows that decide: TE = local (FP32), BF16 by ratio, FP8 tensorwise (N4, N5), N1, the window kernels
    check equivalence 75 --rows equivalence,fp8
    check main_grad 60 --rows main_grad
    if ((ON_CPU)) && [[ -d tests/doubles/transformer_engine ]]; then  # the same row against the tests' TE double
        PYTHONPATH="$PWD/tests/doubles:$PYTHONPATH" FBT_SIMULATED_DEVICE=1 check main_grad_te_double 60 --rows main_grad
    fi
    check kernels 60 --rows kernels
    check performance 60 --rows performance --perf-steps 2
    check offload 60 --rows offload --offload-seq-length 16384 --offload-steps 1
    if ((GPUS >= 2)); then
        check multi_gpu 240 --rows multi_gpu
    else
        not_run multi_gpu "TP 2 + SP and CP 2 need 2+ GPUs; this machine has ${GPUS:-0}"
    fi
    # fbt-1b's width through training (k = 1, 3), checkpoint, resume, reshard and the export, 4 layers
    part rehearsal 180 "$WORK/rehearsal/rehearsal.json" "$PYTHON" tools/rehearse.py --recipe recipes/fbt_1b_100b.yaml \
        --output "$WORK/rehearsal" --num-layers 4 --nproc-per-node 1 --reshard-tp $((GPUS >= 2 ? 2 : 1)) \
        --max-new-tokens 4 --no-vllm -- --bf16 true
fi
"$PYTHON" tools/gpu_check.py --loan-summary "$OUT"
