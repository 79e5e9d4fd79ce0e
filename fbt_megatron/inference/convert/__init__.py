"""Checkpoint conversion between fbt-megatron run folders and Hugging Face model folders.

    python -m fbt_megatron.convert to-hf   --load RUN  --output DIR   [--ckpt-step N] [--tokenizer-model F]
    python -m fbt_megatron.convert from-hf --input DIR --save RUN     [--tensor-model-parallel-size N ...]

* ``to_hf.export``: a run folder (any TP/PP layout it was saved in) → a self-contained HF folder
  (safetensors, config.json, the remote-code model/tokenizer of ``convert/hf/``, README.md) that
  ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` loads offline.
* ``from_hf.import_checkpoint``: such an export, or a Llama-style HF checkpoint (llama, mistral;
  tied embeddings, no biases), → a weights-only megatron checkpoint in a new run folder that
  ``runs.load_run`` and training (``--load``) start from.
* ``mapping``: the one name/shape mapping between megatron's and the HF model's weights, both ways,
  and between ``FBTConfig`` and config.json.
"""

from fbt_megatron.inference.convert.mapping import ConversionError  # noqa: F401
