"""The model spread over ranks for training: ``pipeline`` (the pass-aware pipeline: k passes as
k virtual stages of megatron-core's schedule) and ``data_parallel`` (DDP for multi-pass steps).
Tensor and sequence parallelism live in the model's own layers (megatron-core's, and
``model.sequence`` for the sharded right shift)."""
