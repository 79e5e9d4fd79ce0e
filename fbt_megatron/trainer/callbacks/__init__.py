"""What watches and steers a run's steps: the loop's callbacks (the protocol: ``base``; a run's,
from its recipe, in their order: ``registry``): the training log's writer (``metrics_writer``:
stdout, ``metrics.jsonl``, TensorBoard), injected faults for drills (``faults``), the largest
rank's memory in each record (``memory``), the ranks slower than the others (``stragglers``:
``<save>/stragglers.jsonl``), Weights & Biases (``wandb_writer``), the loss-spike check and rewind
(``spikes``, its state saved in every checkpoint), ``<save>/heartbeat.json`` for cluster monitors
(``heartbeat``), ``<save>/timeline.jsonl`` for the goodput account (``timeline``), the hang watchdog
(``watchdog``) and the planner's memory estimate beside the first step's (``planned_memory``, added
by the training command). ``fbt_megatron.trainer.metrics`` makes the records these carry."""
