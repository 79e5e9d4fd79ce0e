"""Synthetic tasks that probe what latent feedback adds: ``state_tracking`` (the data) and
``evaluate`` (accuracy by position after n fused passes and under the full recurrence)."""
