"""fbt-megatron: Megatron-style pretraining of Full-Bandwidth Transformers."""

__version__ = "0.1.0"
