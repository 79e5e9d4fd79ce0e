"""Synthetic tasks that probe what latent feedback adds: ``evaluate`` (accuracy by position after n
fused passes and under the full recurrence) of runs trained on the state-tracking tasks, whose
data is ``fbt_megatron.data.state_tracking``."""
