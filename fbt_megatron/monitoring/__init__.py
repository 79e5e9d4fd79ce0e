"""Watching a run from outside: Weights & Biases (``wandb_writer``), each layer's parameter and
gradient norms (``norms``), and ``<save>/heartbeat.json`` for cluster monitors (``heartbeat``).
``fbt_megatron.metrics`` makes the records these carry."""
