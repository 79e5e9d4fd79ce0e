"""Evaluate a Hugging Face export on the local tasks in this process, one decode mode at a time."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from pathlib import Path
from typing import Dict, Iterable, Optional
from unittest import mock

from fbt_megatron.evaluation.env import offline_environment
from fbt_megatron.evaluation.local_tasks import NEXT_LINE, PERPLEXITY, SPLIT_PERPLEXITY, LocalTasks
from fbt_megatron.inference.serving import require_vllm

# (task, lm-eval metric key, column name) of the table
METRICS = (
    (PERPLEXITY, "word_perplexity,none", "word_perplexity"),
    (PERPLEXITY, "bits_per_byte,none", "bits_per_byte"),
    (NEXT_LINE, "acc,none", "acc"),
    (NEXT_LINE, "acc_norm,none", "acc_norm"),
    (SPLIT_PERPLEXITY, "word_perplexity,none", "split_word_perplexity"),
    (SPLIT_PERPLEXITY, "bits_per_byte,none", "split_bits_per_byte"),
)


def read_export_config(folder: str) -> dict:
    """config.json of a Hugging Face FBT export (FileNotFoundError / ValueError if it is not one)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: not a Hugging Face export (no config.json)")
    try:
        config = json.loads(path.read_text())
    except ValueError:
        raise ValueError(f"{path} is not valid JSON") from None
    if config.get("model_type") != "fbt":
        raise ValueError(f"{folder}: model_type {config.get('model_type')!r}, not an FBT export")
    return config


def quiet_lm_eval() -> None:
    """lm-eval and datasets log every step at INFO/WARNING: keep their errors only."""
    for name in ("lm-eval", "lm_eval", "datasets", "transformers", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


class OneTruncationWarning(logging.Filter):
    """Lets the first of lm-eval's per-request "Truncating ... tokens from the left" warnings
    through, saying that later ones are not shown, and drops the rest."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "tokens from the left" not in record.getMessage():
            return True
        if self.seen:
            return False
        self.seen = True
        record.msg, record.args = (record.getMessage() + " (contexts longer than the model are cut from the left; "
                                   "later truncations are not reported)"), ()
        return True


def one_truncation_warning() -> None:
    """At most one truncation line from lm-eval's ``hf`` model for the rest of this process."""
    logger = logging.getLogger("lm_eval.models.huggingface")
    if not any(isinstance(f, OneTruncationWarning) for f in logger.filters):
        logger.addFilter(OneTruncationWarning())


BACKENDS = ("hf", "vllm")


def export_lm(export: str, backend: str = "hf", batch_size: int = 8, device: Optional[str] = None):
    """lm-eval's model of an export: ``fbt`` (transformers) or ``fbt-vllm`` (vLLM, docs/serving.md)."""
    if backend == "vllm":
        require_vllm("--backend vllm")
        from fbt_megatron.evaluation.vllm_lm import FBTVLLM

        return FBTVLLM(pretrained=str(export), batch_size=batch_size)
    if backend != "hf":
        raise ValueError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    from fbt_megatron.evaluation.lm import FBTLM

    return FBTLM(pretrained=str(export), batch_size=batch_size, **({"device": device} if device else {}))


class ExportEvaluator:
    """One export loaded once (lm-eval's ``fbt`` or ``fbt-vllm`` model), evaluated in any decode mode."""

    def __init__(self, export: str, batch_size: int = 8, device: Optional[str] = None, lm=None, backend: str = "hf"):
        offline_environment()
        quiet_lm_eval()
        self.config = read_export_config(export)
        self.lm = lm if lm is not None else export_lm(export, backend, batch_size, device)

    @property
    def latent_feedback(self) -> bool:
        return bool(self.config.get("latent_feedback", False))

    def evaluate(self, mode: str, tasks: LocalTasks, limit: Optional[int] = None,
                 task_names: Iterable[str] = None, show_progress: bool = False) -> Dict[str, dict]:
        """lm-eval's results dict {task: {metric,filter: value}} of ``mode`` ("standard", "soft",
        "fused(n)") on the local tasks."""
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        from fbt_megatron.model.decode_modes import parse_mode

        decode_mode, passes = parse_mode(mode)
        if decode_mode != "standard" and not self.latent_feedback:
            raise ValueError(f"{mode}: the model has no latent feedback (a baseline supports only standard)")
        self.lm.decode_mode, self.lm.fused_prefill_passes = decode_mode, passes
        self.lm.quiet = not show_progress
        quiet_lm_eval()
        with contextlib.ExitStack() as stack:
            if not show_progress:  # lm-eval's bar over the documents while it builds the requests
                import lm_eval.api.task
                from tqdm import tqdm

                stack.enter_context(mock.patch.object(lm_eval.api.task, "tqdm", functools.partial(tqdm, disable=True)))
            out = simple_evaluate(model=self.lm, tasks=list(task_names or tasks.names),
                                  task_manager=TaskManager(include_path=tasks.folder, include_defaults=False),
                                  limit=limit, log_samples=False, bootstrap_iters=1000)
        return out["results"]


def table_row(results: Dict[str, dict]) -> Dict[str, Optional[float]]:
    """{column: value} of the table's metrics from lm-eval's results."""
    return {column: results.get(task, {}).get(key) for task, key, column in METRICS}
