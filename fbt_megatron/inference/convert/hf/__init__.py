"""Hugging Face model code of FBT exports (copied verbatim into export folders: imports nothing
from fbt_megatron, only torch, transformers and sentencepiece)."""
