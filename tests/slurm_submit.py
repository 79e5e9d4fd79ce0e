"""``python -m fbt_megatron.slurm`` for ``tests/forked.py``, with what a submission imports (the
recipe's flags, the planner and the model it builds on the meta device, megatron-core) loaded once
in the parent process, so that each forked command line pays only for its own work."""

import fbt_megatron.launch.plan.planner  # noqa: F401
import fbt_megatron.model.fbt_model  # noqa: F401
from fbt_megatron.launch.slurm import preflight, submit  # noqa: F401
from fbt_megatron.commands.slurm import main  # noqa: F401
