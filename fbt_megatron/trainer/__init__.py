"""The trainer: a run from its recipe to its last checkpoint.

loop         ``train(recipe)``: set up, then every step top to bottom (read it first)
data, build  the run's tokenizer and datasets; its model and optimizer
passes       the pass schedule (k per step)
step         one training step (megatron-core's schedule, k passes per microbatch), validation
bad_steps    steps skipped on a non-finite loss or gradient
metrics      the log: records, stdout, metrics.jsonl, TensorBoard
stopping     signals and the time budget; torchrun that lets the workers save
saver        when to save and when to exit
checkpointing  megatron-core's dist_checkpointing on disk, the run's state
stages       where a run starts: from scratch, resumed, or from another run's weights
callbacks/   what watches a step: W&B, norms, heartbeat, ranks, stragglers, faults, spikes, the watchdog
"""
