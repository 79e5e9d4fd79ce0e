"""One small module per parallelism: ``pipeline`` (the pass-aware pipeline), ``data`` (DDP for
multi-pass steps); the sequence's layout under SP/CP, which the fusion itself uses, is
``fbt_megatron.sequence``."""
