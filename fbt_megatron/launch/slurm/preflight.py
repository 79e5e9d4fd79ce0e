"""What would make a job fail after it has queued, found before it is submitted (``--dry-run``
shows the same). Every stage is planned for the job's nodes × GPUs (``fbt_megatron.plan``: the
layout's divisibility, a global batch that splits over the data-parallel ranks, the memory per GPU);
the files a job reads (data, tokenizer, the weights a stage starts from, an export) exist or are
named as placeholders (``/path/to/...``, ``<...>``); and GPU nodes get an environment that can use
them (not a CPU-only torch, not NVIDIA's stock PyTorch image: a training job checks its image itself,
as its first step, ``image_check.py``). Each problem is one line; ``Check`` collects them with the notes
printed before the jobs (each stage's plan, what ``--fit-global-batch`` changed)."""

from __future__ import annotations

import importlib.util
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from fbt_megatron.launch.slurm.script import Resources, Stage, parse_time
from fbt_megatron.recipe import Recipe, RecipeError
from fbt_megatron.trainer.checkpointing import latest_iteration

log = logging.getLogger(__name__)

PLACEHOLDER = re.compile(r"(^|/)path/to/|<[^<>]*>")


@dataclass
class Check:
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)


def is_placeholder(path: str) -> bool:
    """A path left as a recipe's example (``/path/to/your_text_document``, ``<DATA>``)."""
    return bool(PLACEHOLDER.search(path))


def _missing(key: str, path: str, files: List[str], what: str, prepared: Sequence[Path] = ()) -> Optional[str]:
    """The problem with a path a job reads (None: its files exist, seen from the work folder where
    the job runs, or lie in a folder that an earlier stage ``prepared``); ``key``: a recipe field
    (its flag is the fix) or a command-line argument."""
    fix = f" (--{key.split('.')[-1].replace('_', '-')})" if "." in key else ""
    if is_placeholder(path):
        return f"{key} {path} is a placeholder: give {what}{fix}"
    absent = [f for f in files if not Path(f).exists() and not any(Path(f).resolve().is_relative_to(p) for p in prepared)]
    if absent:
        return f"{key} {path}: {' and '.join(absent)} not found (expected: {what}; relative paths start at {Path.cwd()})"
    return None


def prepared_folder(recipe: Recipe) -> Optional[Path]:
    """The corpus folder the training prepares from ``data.corpus`` on first use (None: it reads
    existing files): what it holds (e.g. the tokenizer) is there for the stages after it."""
    d = recipe.data
    if d.train_data_path is None and d.data_path is not None and d.corpus is not None and not Path(d.data_path).exists():
        return Path(d.data_path).resolve()
    return None


def data_problems(recipe: Recipe, prepared: Sequence[Path] = ()) -> List[str]:
    """The data and tokenizer files the training reads, each present (or in a folder ``prepared``
    by an earlier stage) or a problem line: a blend's .bin/.idx prefixes or SFT chat .jsonl files,
    the tokenizer; a prepared corpus folder, or the source it is prepared from on first use."""
    d, found = recipe.data, []
    if d.train_data_path is not None:
        for key in ("train_data_path", "valid_data_path"):
            for item in getattr(d, key) or []:
                if isinstance(item, (int, float)):
                    continue  # a blend weight
                path = str(item)
                files = [path] if d.sft else [path + ".bin", path + ".idx"]
                found.append(_missing(f"data.{key}", path, files, "chat .jsonl files" if d.sft else "a Megatron blend", prepared))
    elif d.data_path is None:
        pass  # neither: the recipe's own check says so
    elif prepared_folder(recipe) is None:
        found.append(_missing("data.data_path", d.data_path, [d.data_path], "a prepared corpus folder", prepared))
    else:  # prepared from data.corpus on first use: a file or folder, unless embedded or generated
        source = d.corpus[len("sft:"):] if d.corpus.startswith("sft:") else d.corpus
        if source != "stdlib" and not source.startswith("state_tracking:"):
            found.append(_missing("data.corpus", source, [source], "the source the corpus is prepared from", prepared))
    if d.tokenizer_model is not None:
        found.append(_missing("data.tokenizer_model", d.tokenizer_model, [d.tokenizer_model], "the tokenizer file",
                              [*prepared, *filter(None, [prepared_folder(recipe)])]))
    found = [problem for problem in found if problem]
    if not found and d.train_data_path is not None and not d.sft:
        found += vocabulary_problems(recipe)
    return found


def vocabulary_problems(recipe: Recipe) -> List[str]:
    """A blend's token ids against its tokenizer (``data.datasets.token_id_problem``: a sample of
    each prefix), and the tokenizer against the vocabulary the stage is planned with (the preset's:
    a larger tokenizer would not fit the plan). A file that does not read as a tokenizer is left to
    the run's own one-line refusal at start."""
    from fbt_megatron.data.datasets import token_id_problem
    from fbt_megatron.data.tokenizer import load_tokenizer
    from fbt_megatron.model.config import PRESETS

    d = recipe.data
    try:
        size = load_tokenizer(d.tokenizer_model).vocab_size
    except ValueError:
        return []
    planned = PRESETS[recipe.model.preset]["vocab_size"]
    found = [token_id_problem(str(item), size, d.tokenizer_model, f"data.{key}")
             for key in ("train_data_path", "valid_data_path") for item in getattr(d, key) or []
             if not isinstance(item, (int, float))]
    if size > planned:
        found.append(f"data.tokenizer_model {d.tokenizer_model} has {size:,} ids, more than the {planned:,} of the "
                     f"{recipe.model.preset} model the recipe plans: use a tokenizer of at most {planned:,} ids")
    return [problem for problem in found if problem]


def vocabulary_note(recipe: Recipe) -> Optional[str]:
    """A line when a blend's tokenizer is smaller than the preset's vocabulary: the run's embedding
    has the tokenizer's size, not the one the recipe was planned with."""
    from fbt_megatron.data.tokenizer import load_tokenizer
    from fbt_megatron.model.config import PRESETS

    d = recipe.data
    if d.train_data_path is None or d.sft or d.tokenizer_model is None or not Path(d.tokenizer_model).is_file():
        return None
    try:
        size = load_tokenizer(d.tokenizer_model).vocab_size
    except ValueError:
        return None
    planned = PRESETS[recipe.model.preset]["vocab_size"]
    if size >= planned:
        return None
    return (f"note: the tokenizer {d.tokenizer_model} has {size:,} ids: the model's embedding has that many rows, not "
            f"the {planned:,} of the {recipe.model.preset} preset (parameters and the plan are smaller)")


# NVIDIA's PyTorch image as it ships (pyxis/enroot spell the registry either way): no megatron-core,
# no transformers, not this project. The project's image is built FROM it (packaging/container/Dockerfile).
STOCK_NGC_PYTORCH = re.compile(r"(docker://)?nvcr\.io[/#]nvidia/pytorch:")
PROJECT_IMAGE = "the project's image (packaging/container/Dockerfile: NGC PyTorch and the wheelhouse, docs/gpu.md#the-container)"


def environment_problems(res: Resources, python: str, vllm: bool = False) -> List[str]:
    """GPU nodes without a container run this Python: its torch must be a GPU build (``vllm``: and
    vLLM must be installed beside it). A container image is checked by the training job itself, as
    its first step on a node (``image_check.py``: megatron-core, Transformer Engine on GPUs, this
    project); here only NVIDIA's stock PyTorch image is refused, which has none of them."""
    if res.container_image:
        if STOCK_NGC_PYTORCH.match(res.container_image):
            fix = ("an image with vLLM and this package (requirements-serve-gpu.txt, docs/serving.md)" if vllm
                   else f"{PROJECT_IMAGE}, built from it")
            return [f"--container-image {res.container_image} is NVIDIA's PyTorch image as it ships, without "
                    f"megatron-core, transformers or this project: give {fix}"]
        return image_file_problems(res)
    problems = []
    if res.gpus_per_node > 0:
        import torch

        if torch.version.cuda is None and torch.version.hip is None:
            problems.append(f"GPU jobs without --container-image run {python}, whose torch {torch.__version__} is a "
                            f"CPU-only build: give --container-image with {PROJECT_IMAGE}, or submit from a Python "
                            "with a CUDA torch and requirements-gpu.txt's packages")
    if vllm and not Path(python).with_name("vllm").exists() and importlib.util.find_spec("vllm") is None:
        problems.append(f"vLLM is not installed beside {python}: pip install -e '.[serve]' (requirements-serve.txt), "
                        "or give --container-image IMAGE with vLLM and this package")
    return problems


IMAGE_FILES = {"pyxis": "a squashfs file made by enroot import", "apptainer": "a .sif file made by apptainer build"}


def image_file_problems(res: Resources) -> List[str]:
    """An image given as a file must exist: pyxis takes an image starting with ``/`` or ``.`` for a
    squashfs file (``pyxis_slurmstepd.c``: ``strspn(image, "./") > 0``), else a registry reference it
    imports; Apptainer takes anything without ``://`` for a file. Seen from the submit host, as the
    data are: a cluster's image lies on the file system its nodes share."""
    image = res.container_image
    is_file = image[:1] in "./" if res.container_runtime == "pyxis" else "://" not in image
    if not is_file:
        return []
    what = f"{IMAGE_FILES[res.container_runtime]}, at a path every node reads (docs/gpu.md#the-container)"
    if is_placeholder(image):
        return [f"--container-image {image} is a placeholder: give {what}"]
    if not Path(image).is_file():
        return [f"--container-image {image}: no such file (expected: {what}; relative paths start at {Path.cwd()})"]
    return []


def mount_problems(res: Resources, paths: Sequence[Tuple[str, Optional[str]]], workdir: Path) -> List[str]:
    """With a container image, every path a job reads or writes (``paths``: (what it is, the path))
    must lie in a folder the container mounts at its own path (``Resources.mounted``): the job is
    given host paths. Each one outside is a problem whose fix names the folder to mount: the path's
    nearest existing folder (a mount's source must exist when the job starts)."""
    if not res.container_image:
        return []
    mounted = res.mounted(workdir)
    problems = []
    for key, path in paths:
        if path is None or is_placeholder(str(path)):
            continue
        target = workdir / path
        if any(target.is_relative_to(m) or target.resolve().is_relative_to(m.resolve()) for m in mounted):
            continue
        source = next(folder for folder in [target, *target.parents] if folder.is_dir())
        first = "" if source != Path(source.anchor) else f" (create {Path(*target.parts[:2])} first)"
        source = source if not first else Path(*target.parts[:2])
        problems.append(f"{key} {path} is not mounted in the container (it mounts {', '.join(map(str, mounted))}): "
                        f"add --container-mounts {source}:{source}{first}")
    return problems


def stage_paths(stage: Stage) -> List[Tuple[str, Optional[str]]]:
    """What a training job reads and writes: its run folder, the run its weights start from, the
    data (a blend's prefixes or chat files, a corpus folder and its source) and the tokenizer."""
    d = stage.config.data
    data = [(f"data.{key}", str(item)) for key in ("train_data_path", "valid_data_path")
            for item in getattr(d, key) or [] if not isinstance(item, (int, float))]
    source = d.corpus[len("sft:"):] if d.corpus and d.corpus.startswith("sft:") else d.corpus
    if source == "stdlib" or (source or "").startswith("state_tracking:"):
        source = None
    return [("--save", str(stage.save)), ("checkpoint.pretrained_checkpoint", stage.pretrained and str(stage.pretrained)),
            *data, ("data.data_path", d.data_path if d.train_data_path is None else None),
            ("data.corpus", source if d.train_data_path is None else None), ("data.tokenizer_model", d.tokenizer_model)]


def tensor_parallel_note(recipe: Recipe, res: Resources) -> Optional[str]:
    """A line when tensor parallelism spans nodes: its all-reduces of every layer's activations then go
    over the network, which the plan's time does not price (it assumes the node's NVLink)."""
    tp = recipe.parallel.tensor_model_parallel_size
    if not res.gpus_per_node or tp <= res.gpus_per_node:
        return None
    return (f"note: --tensor-model-parallel-size {tp} spans nodes of {res.gpus_per_node} GPUs: every layer's all-reduces "
            "would cross the network, several times slower than the NVLink the plan's time assumes, unless the nodes share "
            f"an NVLink domain (NVL72): keep TP at most {res.gpus_per_node} and add pipeline or data parallelism")


def plan_stage(stage: Stage, res: Resources, gpu=None, gpu_memory_gb: Optional[float] = None, fit: bool = False,
               signal_seconds: int = 0, first: bool = True, prepared: Sequence[Path] = ()) -> Check:
    """The problems of one stage on ``res`` (``first``: no stage before it provides its starting
    weights; ``prepared``: corpus folders the stages before it prepare) and the line of its plan. ``fit``: a global batch that does not divide is replaced by
    the nearest that does (the stage's flags get --global-batch-size and --train-iters), with a note;
    otherwise it is a problem naming those flags, and the rest is planned as if they were given."""
    import copy

    from fbt_megatron.launch.plan.planner import _count, batch_fit, gib, make_plan

    problems = []
    world, recipe = res.nodes * res.procs_per_node, stage.config
    batch = batch_fit(recipe, world)
    if batch is not None and fit:
        notes = [batch.apply()]
        stage.flags += batch.flags(batch.nearest).split()
        stage.train_iters = recipe.training.train_iters
    else:
        notes = []
        if batch is not None:
            problems.append(batch.problem())
            recipe = copy.deepcopy(recipe)
            batch_fit(recipe, world).apply()  # plan the rest (memory) as with the suggested flags
    try:
        plan = make_plan(recipe, world, gpu, gpu_memory_gb, transformer_engine=res.gpus_per_node > 0)
    except RecipeError as e:
        problems.append(str(e))
        plan = None
    if first and stage.pretrained is not None and latest_iteration(str(stage.save)) is None:
        problem = _missing("checkpoint.pretrained_checkpoint", str(stage.pretrained), [str(stage.pretrained)],
                           "the run whose weights start this stage")
        if problem is None and latest_iteration(str(stage.pretrained)) is None:
            problem = f"checkpoint.pretrained_checkpoint {stage.pretrained} holds no checkpoint to start from"
        problems += [problem] if problem else []
    problems += data_problems(stage.config, prepared)
    notes += filter(None, [vocabulary_note(stage.config), tensor_parallel_note(recipe, res)])
    if plan is None:
        return Check(problems, notes)
    lay, t = plan.layout, recipe.training
    unit, units = ("GPU", "GPUs") if res.gpus_per_node else ("process", "processes")
    line = (f"plan: {world} {units} as TP {lay.tp} × PP {lay.pp} × CP {lay.cp} × DP {lay.dp}; "
            f"{t.train_iters:,} steps × {t.global_batch_size} × {lay.seq_length:,} tokens ({_count(plan.tokens)}); "
            f"{gib(plan.memory[plan.chosen].total)} GiB per {unit} estimated")
    if plan.gpu_memory is not None:
        line += f" of {gib(plan.gpu_memory)} usable"
    elif res.gpus_per_node:
        line += " (not checked: give --gpu or --gpu-memory-gb)"
    if plan.train_seconds is not None:
        hours = plan.train_seconds / 3600
        jobs = math.ceil(plan.train_seconds / max(parse_time(res.time) - signal_seconds, 60))
        line += (f"; {hours:,.1f} h (model FLOPs at {plan.mfu:.0%} MFU; the log's MFU {plan.logged_mfu:.0%}, "
                 f"{plan.megatron_mfu:.0%} by Megatron-LM's formula): about {jobs} job{'s' if jobs > 1 else ''} of {res.time}")
    return Check(problems, notes + [line])


def plan_stages(stages: List[Stage], res: Resources, gpu=None, gpu_memory_gb: Optional[float] = None, fit: bool = False,
                signal_seconds: int = 0) -> Check:
    """Every stage's problems and notes, each line prefixed with its stage's name."""
    out, prepared = Check(), []
    for i, stage in enumerate(stages):
        check = plan_stage(stage, res, gpu, gpu_memory_gb, fit, signal_seconds, first=i == 0, prepared=prepared)
        prepared += filter(None, [prepared_folder(stage.config)])
        out.problems += [f"{stage.name}: {p}" for p in check.problems]
        out.notes += [f"{stage.name}: {n}" for n in check.notes]
    return out


def model_problems(models: List[str], exports_only: bool = False) -> List[str]:
    """Each model to evaluate: a Hugging Face export (config.json) or a run folder with a checkpoint
    (``exports_only``: to serve, an export)."""
    problems = []
    for model in models:
        what = "an export folder" if exports_only else "an export folder or a run folder"
        problem = _missing("export" if exports_only else "model", model, [model], what)
        if problem is None and not (Path(model) / "config.json").is_file():
            if exports_only:
                problem = (f"{model}: not a Hugging Face export (no config.json): export a run first "
                           "(python -m fbt_megatron.convert to-hf), or evaluate it (python -m fbt_megatron.slurm evaluate)")
            elif latest_iteration(model) is None:
                problem = f"{model}: neither a Hugging Face export (no config.json) nor a run folder with a checkpoint"
        problems += [problem] if problem else []
    return problems


def refuse_on(check: Check, hint: str = "") -> None:
    """Log the problems, one ``error:`` line each, and refuse the submission (``hint``: how to
    give the fixes); else log the notes."""
    if check.problems:
        for problem in check.problems:
            log.error("error: " + " ".join(problem.split()))
        raise RecipeError(f"nothing submitted: {len(check.problems)} problem{'s' if len(check.problems) > 1 else ''} "
                          f"(the lines above){hint}")
    for note in check.notes:
        log.info(note)
