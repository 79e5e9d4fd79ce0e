"""One small module per parallelism: ``sequence`` (SP/CP positions and the shifted carried
state), ``pipeline`` (the pass-aware pipeline), ``data`` (DDP for multi-pass steps)."""
