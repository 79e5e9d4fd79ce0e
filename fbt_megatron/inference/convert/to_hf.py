"""A run folder → a Hugging Face model folder (``python -m fbt_megatron.convert to-hf``).

The run is loaded as one CPU process in fp32 (``runs.load_run``: any TP/PP layout it was saved in,
resharded by dist_checkpointing), its weights renamed and split per ``mapping``, and the folder is
written whole (``io.atomic_folder``): an interrupted export leaves no half-written DIR. DIR
may be missing (its parents are created) or an empty folder; anything else there is refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import string
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from fbt_megatron.common.folders import check_new_folder, current_umask
from fbt_megatron.common.io import atomic_folder
from fbt_megatron.inference.convert import mapping
from fbt_megatron.inference.convert.mapping import ConversionError

HERE = Path(__file__).parent
HF_CODE = HERE / "hf"
MODEL_CODE = ("configuration_fbt.py", "modeling_fbt.py")
TOKENIZER_CODE = "tokenization_fbt.py"
README_TEMPLATE = HERE / "export_readme.md"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
PROGRESS_BYTES = 256 * 2**20  # a progress bar over tensors from this many bytes of weights on


def parse_size(text) -> int:
    """"2GB" → 2·10⁹ bytes (KB/MB/GB/TB decimal, KiB/MiB/GiB/TiB binary, or a number of bytes)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ConversionError(f"--max-shard-size {text!r}: expected a size such as 2GB, 500MB or 1GiB")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    size = int(float(m.group(1)) * scale)
    if size < 1:
        raise ConversionError(f"--max-shard-size {text!r} must be positive")
    return size


def hf_code_files(with_tokenizer: bool) -> List[Path]:
    """The remote-code files copied verbatim into every export."""
    names = [*MODEL_CODE, *([TOKENIZER_CODE] if with_tokenizer else [])]
    files = [HF_CODE / n for n in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConversionError(f"the Hugging Face model code is missing: {', '.join(missing)}")
    return files


# ---------------------------------------------------------------- safetensors
def write_safetensors(tensors: Dict[str, torch.Tensor], folder: Path, max_shard_size: int,
                      progress: Optional[bool] = None) -> List[str]:
    """``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` of at most
    ``max_shard_size`` bytes each (a tensor larger than that gets a shard alone) and
    ``model.safetensors.index.json``. Tensors keep their order. Returns the files written."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_size:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    show = total >= PROGRESS_BYTES if progress is None else progress
    bar = tqdm(total=len(tensors), unit="tensor", desc="writing safetensors", disable=not show)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / WEIGHTS), metadata=metadata)
        bar.update(len(tensors))
        bar.close()
        return [WEIGHTS]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata=metadata)
        weight_map.update({k: name for k in shard})
        names.append(name)
        bar.update(len(shard))
    bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names + [WEIGHTS_INDEX]


def read_safetensors(folder: Path) -> Dict[str, torch.Tensor]:
    """All tensors of an HF folder (one file or the shards its index names), in stored order."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    if (folder / WEIGHTS).is_file():
        files = [folder / WEIGHTS]
    elif (folder / WEIGHTS_INDEX).is_file():
        try:
            weight_map = json.loads((folder / WEIGHTS_INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ConversionError(f"{folder / WEIGHTS_INDEX} is unreadable") from None
        files = [folder / n for n in dict.fromkeys(weight_map.values())]
    else:
        raise ConversionError(f"{folder} has no {WEIGHTS} or {WEIGHTS_INDEX} (only safetensors checkpoints are read)")
    out = {}
    for f in files:
        if not f.is_file():
            raise ConversionError(f"{f} is missing (named by {WEIGHTS_INDEX})")
        try:
            out.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ConversionError(f"{f} is not a readable safetensors file: {e}") from None
    return out


# ---------------------------------------------------------------- tokenizer
def sentencepiece_specials(path: str) -> dict:
    """The special pieces of a sentencepiece model: {role: (id, piece)} for bos/eos/unk/pad."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    out = {}
    for role, i in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("unk", sp.unk_id()), ("pad", sp.pad_id())):
        if i is not None and 0 <= i < sp.get_piece_size():
            out[role] = (i, sp.id_to_piece(i))
    return out


def write_tokenizer(folder: Path, model_file: str, max_length: int, chat_template: Optional[str] = None) -> None:
    """The remote-code sentencepiece tokenizer: ``tokenizer.model`` (the run's file, copied),
    ``tokenizer_config.json`` (with ``chat_template``, an SFT run's, which ``apply_chat_template``
    and vLLM's chat endpoint read) and ``special_tokens_map.json``. No BOS/EOS is added to encoded
    text: training documents are plain pieces with EOD between documents."""
    shutil.copyfile(model_file, folder / "tokenizer.model")
    specials = sentencepiece_specials(model_file)
    tokens = {f"{role}_token": piece for role, (_, piece) in specials.items()}
    if "pad" not in specials and "eos" in specials:
        tokens["pad_token"] = specials["eos"][1]  # the run pads with EOD when the model has no pad piece
    config = {
        "tokenizer_class": "FBTTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_fbt.FBTTokenizer", None]},
        **tokens,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        "model_max_length": max_length,
        "padding_side": "left",
        **({"chat_template": chat_template} if chat_template is not None else {}),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(tokens, indent=2) + "\n")


def run_chat_template(run) -> tuple:
    """(the chat template an SFT run trained with, or None; why there is none where it should be):
    the ``tokenizer_config.json`` beside the tokenizer of its SFT data (``data.sft``), else the
    default template, as training chose it. A run that is not SFT has none (and no reason)."""
    if not getattr(run.recipe.data, "sft", False):
        return None, None
    from fbt_megatron.data.sft import sft_chat_template

    try:
        return sft_chat_template(run.recipe.data)[0], None
    except (ValueError, OSError) as e:
        return None, f"the SFT run's data is not where it was trained ({e})"


def tokenizer_ids(run) -> tuple:
    """(bos, eos, pad) of the run's tokenizer (None where it has none)."""
    tok = run.tokenizer
    eos = getattr(tok, "eod", None)
    pad = getattr(tok, "pad", None)
    bos = None
    if run.tokenizer_path and sentencepiece_file(run):
        bos = sentencepiece_specials(run.tokenizer_path).get("bos", (None,))[0]
    return bos, eos, pad if pad is not None else eos


def sentencepiece_file(run) -> bool:
    from fbt_megatron.data.tokenizer import SentencePieceTokenizer

    return isinstance(run.tokenizer, SentencePieceTokenizer)


def no_tokenizer_reason(run) -> Optional[str]:
    """Why the run's tokenizer is not exported (None: it is)."""
    if run.tokenizer_path is None:
        return "the run's vocabulary is a state-tracking task's (no text tokenizer)"
    if not sentencepiece_file(run):
        kind = getattr(run.tokenizer, "kind", "") or "non-sentencepiece"
        return f"the run's tokenizer {Path(run.tokenizer_path).name} is a {kind} tokenizer (only sentencepiece is exported)"
    return None


# ---------------------------------------------------------------- README and generation config
def generation_config(bos, eos, pad) -> dict:
    from transformers import __version__

    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "transformers_version": __version__}


def architecture(c) -> str:
    """The backbone in words, as this config has it."""
    if c.sandwich_norm:
        layer = (f"Every layer is `h ← h + α·RMSNorm_post(Sublayer(RMSNorm_pre(h)))` (sandwich norms, depth-scaled "
                 f"residual α = `residual_scale` = {c.depth_scale:.6g})")
    else:
        layer = f"Every layer is `h ← h + α·Sublayer(RMSNorm_pre(h))` (pre-norm, α = `residual_scale` = {c.depth_scale:.6g})"
    attention = ["grouped-query" + (" with RMS-normalised queries and keys" if c.qk_layernorm else ""), "RoPE"]
    if c.headwise_attention_gate:
        attention.append("a headwise sigmoid gate on each head's output")
    if c.sliding_window is not None:
        k = c.full_attention_every
        where = (f"every layer but those whose number is a multiple of {k} (global)" if k else "every layer")
        attention.append(f"a sliding window of {c.sliding_window} tokens on {where}")
    return (f"{layer}; attention is {', '.join(attention[:-1])} and {attention[-1]}; the MLP is SwiGLU; "
            f"logits = `model.norm(h_L) · E^T` (tied embeddings).")


def example(c, with_tokenizer: bool) -> str:
    """The loading example of the README."""
    mode = ', decode_mode="fused", fused_prefill_passes=2' if c.latent_feedback else ""
    lines = ["import torch", "from transformers import AutoModelForCausalLM" + (", AutoTokenizer" if with_tokenizer else ""), "",
             'model = AutoModelForCausalLM.from_pretrained("PATH", trust_remote_code=True, dtype=torch.float32).eval()']
    if with_tokenizer:
        lines += ['tokenizer = AutoTokenizer.from_pretrained("PATH", trust_remote_code=True)',
                  'ids = tokenizer("def main():", return_tensors="pt").input_ids',
                  f"out = model.generate(ids, max_new_tokens=32, do_sample=False{mode})",
                  "print(tokenizer.decode(out[0]))"]
    else:
        lines += ["ids = torch.tensor([[1, 2, 3]])  # token ids of the run's own vocabulary (no tokenizer exported)",
                  f"out = model.generate(ids, max_new_tokens=8, do_sample=False{mode})"]
    return "\n".join(lines)


def readme(run, config: dict, tokenizer_note: Optional[str], files: List[str]) -> str:
    c = run.model.config
    params = sum(p.numel() for p in run.model.parameters())
    keys = "\n".join(f"| `{k}` | `{json.dumps(v)}` |" for k, v in config.items()
                     if k not in ("auto_map", "architectures", "layer_types"))
    values = dict(
        name=Path(run.folder).name,
        source=str(Path(run.folder).resolve()),
        iteration=run.iteration,
        preset=run.recipe.model.preset,
        parameters=f"{params:,}",
        layers=c.num_layers,
        hidden=c.hidden_size,
        vocab=c.vocab_size,
        latent=("with latent feedback (FBT)" if c.latent_feedback
                else "without latent feedback (the baseline: standard decoding only)"),
        tokenizer=(tokenizer_note or "the run's sentencepiece model (`tokenizer.model`) as a remote-code "
                   "`FBTTokenizer`; no BOS/EOS is added to encoded text"),
        config_keys=keys,
        default_mode=config["decode_mode"],
        architecture=architecture(c),
        example=example(c, tokenizer_note is None),
        weights=", ".join(f"`{f}`" for f in files),
    )
    return string.Template(README_TEMPLATE.read_text()).substitute(values)


# ---------------------------------------------------------------- the export
def readable(folder: Path) -> None:
    """Files as the umask allows (safetensors writes its files owner-only)."""
    umask = current_umask()
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def export(load: str, output: str, ckpt_step: Optional[int] = None, tokenizer_model: Optional[str] = None,
           max_shard_size="2GB", progress: Optional[bool] = None, say: Callable[[str], None] = print,
           dtype: str = "float32") -> Path:
    """Export run folder ``load`` (its latest checkpoint, or ``ckpt_step``'s) to the new HF folder
    ``output``, its weights in ``dtype`` (float32 or bfloat16); returns it. Raises ValueError (one
    line) for what cannot be exported."""
    from fbt_megatron.inference.runs import load_run

    out = check_new_folder(output, "--output")
    shard_bytes = parse_size(max_shard_size)
    hf_code_files(with_tokenizer=False)  # before the (long) load: the model code must be there
    run = load_run(load, iteration=ckpt_step, tokenizer_model=tokenizer_model)
    c = run.model.config
    shape = mapping.Shape.of_config(c)
    tensors = mapping.to_hf({k: v for k, v in run.model.state_dict().items() if torch.is_tensor(v)}, shape)
    tensors = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}

    skipped = no_tokenizer_reason(run)
    bos, eos, pad = tokenizer_ids(run)
    config = {**mapping.hf_config(c, bos, eos, pad, with_tokenizer=skipped is None), "torch_dtype": dtype, "dtype": dtype}
    with atomic_folder(out) as tmp:
        files = write_safetensors(tensors, tmp, shard_bytes, progress)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(bos, eos, pad), indent=2) + "\n")
        for f in hf_code_files(with_tokenizer=skipped is None):
            shutil.copyfile(f, tmp / f.name)
        template, no_template = run_chat_template(run) if skipped is None else (None, None)
        if skipped is None:
            write_tokenizer(tmp, run.tokenizer_path, c.seq_length, template)
        note = None if skipped is None else f"no tokenizer exported: {skipped}"
        (tmp / "README.md").write_text(readme(run, config, note, files))
        readable(tmp)
    if skipped:
        say(f"note: no tokenizer exported: {skipped}")
    if no_template:
        say(f"note: no chat template exported: {no_template}")
    params = sum(t.numel() for t in tensors.values())
    say(f"exported {run.folder} (iteration {run.iteration}, {params:,} parameters) to {out}")
    return out
