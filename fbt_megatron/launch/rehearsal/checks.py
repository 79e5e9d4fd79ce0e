"""The rehearsal's comparisons, from what the stages left on disk and printed."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics


def metrics(run: Path) -> Dict[int, dict]:
    """A run folder's logged records by step."""
    return {r["step"]: r for r in read_metrics(run)}


def relative_difference(a: list, b: list) -> float:
    """The largest relative difference between two lists of numbers (inf when their lengths differ)."""
    if len(a) != len(b):
        return float("inf")
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))


def trained_parameters(stage) -> int:
    """The parameter count the training entry point's first log line states."""
    line = next(text for _, text in stage.lines if text.startswith("fbt-megatron:"))
    return int(line.split(" parameters")[0].rsplit(" ", 1)[-1].replace(",", ""))


def same_safetensors(a: Path, b: Path) -> tuple:
    """(description, equal): two exports' tensors compared one at a time (names, dtypes, bits)."""
    import torch
    from safetensors import safe_open

    def index(folder: Path) -> Dict[str, Path]:
        files = sorted(folder.glob("*.safetensors"))
        out = {}
        for f in files:
            with safe_open(str(f), "pt") as st:
                out.update({k: f for k in st.keys()})
        return out

    ia, ib = index(a), index(b)
    if set(ia) != set(ib):
        return f"tensor names differ ({len(set(ia) ^ set(ib))} names)", False
    differ, elements = [], 0
    for name in ia:
        with safe_open(str(ia[name]), "pt") as fa, safe_open(str(ib[name]), "pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
        elements += x.numel()
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
                                                                         y.view(torch.int16) if y.dtype == torch.bfloat16 else y):
            differ.append(name)
    if differ:
        return f"{len(differ)} of {len(ia)} tensors differ (first: {differ[0]})", False
    return f"{len(ia)} tensors, {elements:,} values bit-identical", True


def same_checkpoint(a: Path, b: Path) -> tuple:
    """(description, equal): two torch_dist checkpoints of the same state, their data files
    (``*.distcp``: every tensor and the optimizer's objects) compared byte for byte; the rest may
    differ (``.metadata`` holds the folder and a random save id, ``common.pt`` the run's arguments)."""
    import filecmp

    names = lambda folder: sorted(f.name for f in folder.iterdir() if f.suffix == ".distcp")  # noqa: E731
    na, nb = names(a), names(b)
    if na != nb or not na:
        return f"files differ: {na} vs {nb}", False
    differ = [n for n in na if not filecmp.cmp(a / n, b / n, shallow=False)]
    size = sum((a / n).stat().st_size for n in na)
    if differ:
        return f"{len(differ)} of {len(na)} files differ (first: {differ[0]})", False
    return f"{len(na)} files, {size / 2 ** 30:.2f} GiB byte-identical", True


def generated_ids(stage, prompt_length: int) -> List[int]:
    """The ids after the prompt that ``generate --print-ids`` printed for its one sequence."""
    lines = [text for _, text in stage.lines]
    at = next(i for i, text in enumerate(lines) if text.startswith("--- 1 "))
    return [int(x) for x in lines[at + 1].split()][prompt_length:]


def describe_tokens(hf: List[int], other: List[int], name: str = "megatron") -> str:
    if hf == other:
        return f"{len(hf)} tokens equal: {' '.join(map(str, hf))}"
    first = next((i for i, (x, y) in enumerate(zip(hf, other)) if x != y), min(len(hf), len(other)))
    return f"differ from token {first}: transformers {hf} {name} {other}"
