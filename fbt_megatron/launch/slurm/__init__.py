"""Slurm jobs for fbt-megatron. ``python -m fbt_megatron.slurm submit`` renders a job script from a
template in slurm/ (``script``) and submits it with sbatch, one stage or a chain of stages followed
by an export + evaluation job (``submit``); inside a job, ``launch`` starts the training processes
(torchrun per node, or one task per GPU). slurm/README.md describes the jobs: time limits and
requeue, chains, launch modes, logs."""
