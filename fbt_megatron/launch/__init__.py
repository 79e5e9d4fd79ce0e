"""Before and around a run: ``plan`` (memory, FLOPs and time of a layout), ``rehearsal`` (a recipe's
model at full width through every entry point), ``slurm`` (job scripts, submission, launch inside a
job, corpus preparation) and ``attempts`` (a Slurm job's attempts and retry budget, run by the
batch shell)."""
