"""The trainer: a run from its recipe to its last checkpoint.

loop         ``train(recipe)``: set up, then every step top to bottom (read it first)
data, build  the run's tokenizer and datasets; its model and optimizer
passes       the pass schedule (k per step)
step         one training step (megatron-core's schedule, k passes per microbatch), validation
bad_steps    steps skipped on a non-finite loss or gradient
metrics      the log's records: time, losses, throughput (written by callbacks/metrics_writer)
stopping     when a run stops: signals, the time budget, --exit-interval; torchrun that lets the workers save
checkpointing  megatron-core's dist_checkpointing on disk, the run's state
stages       where a run starts: from scratch, resumed, or from another run's weights
callbacks/   what a run does beside its steps: the log's writer, the checkpointer, W&B, memory, stragglers,
             heartbeat, timeline, faults, spikes, the watchdog
"""
