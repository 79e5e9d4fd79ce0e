"""Trained runs at work: ``runs`` (a run folder loaded for inference), ``generate`` (decoding in the
paper's modes with a KV cache), ``convert`` (run folders ↔ Hugging Face folders) and ``serving``
(vLLM)."""
