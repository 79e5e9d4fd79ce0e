"""The rows of ``tools/gpu_check.py``, one module per group, each with ``TITLE``, ``EXACT`` (whether its
rows compare closely: TE's attention is then deterministic) and ``run(ctx)``; every row
goes to one ``CheckReport`` (``fbt_megatron/launch/rehearsal/report.py``, the rehearsal's too): PASS,
FAIL, SKIP (with its reason) or INFO, with the value measured and the criterion it was held to.

gate         the environment gate: GPU, a kernel, megatron-core, Transformer Engine, exact-comparison environment
equivalence  TE spec vs local spec, FP32 (tight) and BF16 (each path against FP32, by ratio)
fp8          FP8 at current scaling (tensorwise) vs BF16; recompute on vs off, tight; delayed at loss level
main_grad    N1: DDP's main_grad after k = 3 passes, 2 microbatches, gradient-accumulation fusion on vs off
kernels      TE's flash/fused attention at fbt-1b's heads and window, by ratio; the backend on a window layer
performance  fbt-1b tokens/s, MFU, peak memory; the planner's memory within 20%
offload      long context: recompute inputs kept vs offloaded to host memory
multi_gpu    TP 2 + SP (Adam, NorMuon), CP 2 vs 1 GPU through the entry point (2+ GPUs)
slurm_job    a 2-node job through slurm/train.sbatch with the time-limit signal (from a login node)
machine      what this machine has (``Machine``), read once per process
harness      what the rows share: models, batches, a step's gradients, the two gradient measures
loan         tools/gpu_loan.sh's one report over its parts
"""

from gpu_checks import equivalence, fp8, kernels, main_grad, multi_gpu, offload, performance, slurm_job

# --rows name → module; the gate is run apart (before the platform starts: it must not need it)
GROUPS = {"equivalence": equivalence, "fp8": fp8, "main_grad": main_grad, "kernels": kernels, "performance": performance,
          "offload": offload, "multi_gpu": multi_gpu, "slurm": slurm_job}
