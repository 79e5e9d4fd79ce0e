"""What watches and steers a run's steps. The loop's callbacks (the protocol: ``base``; a run's,
from its recipe, in their order: ``registry``): injected faults for drills (``faults``), Weights &
Biases (``wandb_writer``), the loss-spike rewind (``spikes``), ``<save>/heartbeat.json`` for cluster
monitors (``heartbeat``) and the hang watchdog (``watchdog``). The step's and the log's helpers:
each layer's parameter and gradient norms (``norms``), loss-spike detection (``spikes``), which
node each rank runs on (``ranks``: ``<save>/ranks.json``), the ranks slower than the others
(``stragglers``: ``<save>/stragglers.jsonl``). ``fbt_megatron.trainer.metrics`` makes the records
these carry."""
