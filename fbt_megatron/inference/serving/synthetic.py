"""A random FBT export of a given shape, written as ``to-hf`` lays out a folder (config.json with
the remote-code ``auto_map``, model.safetensors without the tied lm_head, the model code of
``convert/hf/``, optionally a sentencepiece tokenizer): what the serving tests and
``tools/benchmark.py --serving`` load when no trained export is given. Norm weights are drawn around
1 and embeddings wide, so logits are sharp and greedy choices far from ties."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, sliding_window=16, full_attention_every=2,
            max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=3)


def write_export(folder, seed: int = 0, tokenizer_model: Optional[str] = None, **overrides) -> Path:
    import torch

    from fbt_megatron.inference.convert import to_hf
    from fbt_megatron.inference.convert.hf.configuration_fbt import FBTConfig
    from fbt_megatron.inference.convert.hf.modeling_fbt import FBTForCausalLM

    folder = Path(folder)
    torch.manual_seed(seed)
    config = FBTConfig(**{**TINY, **overrides})
    model = FBTForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "embed_tokens" in name:
                p.normal_(0, 0.5)
    with_tokenizer = tokenizer_model is not None
    model.config.auto_map = {"AutoConfig": "configuration_fbt.FBTConfig",
                             "AutoModelForCausalLM": "modeling_fbt.FBTForCausalLM"}
    if with_tokenizer:
        model.config.auto_map["AutoTokenizer"] = ["tokenization_fbt.FBTTokenizer", None]
    model.save_pretrained(folder)
    for f in to_hf.hf_code_files(with_tokenizer):
        shutil.copyfile(f, folder / f.name)
    if with_tokenizer:
        to_hf.write_tokenizer(folder, tokenizer_model, config.max_position_embeddings)
    return folder
