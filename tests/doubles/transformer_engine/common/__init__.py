"""TE's framework-independent part: only the FP8 recipes (``recipe``)."""

from transformer_engine.common import recipe  # noqa: F401
