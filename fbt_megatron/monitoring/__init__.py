"""Watching a run from outside: Weights & Biases (``wandb_writer``), each layer's parameter and
gradient norms (``norms``), ``<save>/heartbeat.json`` for cluster monitors (``heartbeat``), which
node each rank runs on (``ranks``: ``<save>/ranks.json``) and the ranks slower than the others
(``stragglers``: ``<save>/stragglers.jsonl``). ``fbt_megatron.metrics`` makes the records these carry."""
