"""A study file: a declared grid of training runs (data × model × length × seed × threads).

A study file (``recipes/studies/*.yaml``) names its data, its models and one or more grids::

    name: compute_for_data
    corpus: {source: stdlib, path: data/stdlib-sp2048, vocab_size: 2048}   # under --root; prepared if missing
    data:                                       # what a run trains on
      100k: {subset_tokens: 100000}             #   whole documents of the corpus's train split (studies.subsets;
                                                #   rules: order_seed, max_shared_lines, max_document_share)
      parity: {flags: {corpus: "state_tracking:parity", data-path: "{root}/data/parity-32"}}
    models:                                     # a recipe and flags over it
      baseline: {recipe: recipes/tiny_cpu_baseline.yaml}
      fbt_k2: {recipe: recipes/tiny_cpu.yaml, flags: {passes: 2, pass-phases: null}}
    flags: {eval-iters: 20}                     # for every run
    validations: 8                              # per run at most (--eval-interval, a multiple of --log-interval); checkpoints as often
    evaluate: {sequences: 64, lengths: [1, 2, 4]}   # optional: fbt_megatron.evaluation.tasks.evaluate after training
    grids:
      full:
        seeds: [1, 2, 3]
        threads: [1]
        cells:                                  # each a product of its lists
          - {data: [100k], models: [baseline], epochs: [5, 10]}
          - {data: [100k], models: [baseline], epochs: [10], equal_compute: [fbt_k2]}  # 10 × k̄(fbt_k2) epochs
          - {data: [parity], models: [fbt], steps: [1500]}

A run's length is ``epochs`` of its subset (steps = epochs × subset tokens / tokens per step,
rounded), ``steps``, or the recipe's ``train_iters``. ``equal_compute`` names models whose mean
passes per step k̄ (from their recipe's pass schedule) multiply the epochs: the baseline given the
compute of that model. Flag values may use ``{root}``. Every run is a command line of the training
entry point; its folder is ``ROOT/NAME/DATA/MODEL/LENGTH/seedS-tT``.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class RunSpec:
    """One training run of a grid: what it is, where it lives and the entry point's flags."""

    study: str
    data: str
    model: str
    length: str  # "e10", "e20=10×k2", "s1500" or "recipe"
    seed: int
    threads: int
    folder: Path
    recipe: Path
    flags: tuple  # the entry point's flags besides --recipe/--save/--load (strings)
    steps: int
    epochs: Optional[float]  # None when the data is not a subset
    mean_passes: float  # k̄ of the model's pass schedule: the compute per token
    compute_of: Optional[str] = None  # the model whose compute this run matches (epochs × its k̄)
    evaluate: Optional[dict] = None  # fbt_megatron.evaluation.tasks.evaluate's settings, for task runs

    @property
    def cell(self) -> tuple:
        """What seeds are repeats of: everything but the seed."""
        return (self.data, self.model, self.length, self.threads)

    @property
    def label(self) -> str:
        return f"{self.data} {self.model} {self.length} seed {self.seed}" + (f" t{self.threads}" if self.threads != 1 else "")


@dataclass
class Study:
    name: str
    path: Path
    data: Dict[str, dict]
    models: Dict[str, dict]
    grids: Dict[str, dict]
    corpus: Optional[dict] = None
    flags: Dict[str, Any] = field(default_factory=dict)
    validations: int = 8
    evaluate: Optional[dict] = None

    def corpus_folder(self, root: Path) -> Path:
        return root / self.corpus["path"]

    def subset_folder(self, root: Path, data: str) -> Path:
        return root / "data" / f"{self.name}-{data}"

    def run_folder(self, root: Path, data: str, model: str, length: str, seed: int, threads: int) -> Path:
        return root / self.name / data / model / length / f"seed{seed}-t{threads}"

    def grid(self, name: str) -> dict:
        """The grid ``name`` (ValueError naming the grids there are)."""
        if name not in self.grids:
            raise ValueError(f"{self.path} has no grid {name!r}; its grids: {', '.join(self.grids)}")
        return self.grids[name]


KEYS = {"name", "corpus", "data", "models", "flags", "validations", "evaluate", "grids"}
CELL_KEYS = {"data", "models", "epochs", "steps", "equal_compute"}
SUBSET_RULES = ("order_seed", "max_shared_lines", "max_document_share")  # studies.subsets.prepare_subset's rules
DATA_KEYS = {"subset_tokens", "flags", *SUBSET_RULES}


def load_study(path) -> Study:
    """The study file at ``path`` (ValueError naming the problem)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read the study file {path}: {e}") from None
    if not isinstance(raw, dict) or not {"name", "data", "models", "grids"} <= set(raw):
        raise ValueError(f"{path} is not a study file: it needs name, data, models and grids")
    unknown = set(raw) - KEYS
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)} (known: {sorted(KEYS)})")
    study = Study(path=path, **raw)
    for name, data in study.data.items():
        if set(data) - DATA_KEYS:
            raise ValueError(f"{path}: data {name}: unknown keys {sorted(set(data) - DATA_KEYS)} (known: {sorted(DATA_KEYS)})")
        if set(SUBSET_RULES) & set(data) and "subset_tokens" not in data:
            raise ValueError(f"{path}: data {name}: {sorted(set(SUBSET_RULES) & set(data))} choose a subset: give subset_tokens")
    for name, model in study.models.items():
        recipe = model.get("recipe") if isinstance(model, dict) else None
        if not recipe or not (REPO / recipe).is_file():
            raise ValueError(f"{path}: model {name} needs a recipe file (relative to {REPO}): got {model!r}")
    if any("subset_tokens" in d for d in study.data.values()) and not study.corpus:
        raise ValueError(f"{path}: data with subset_tokens need a corpus: {{source, path, vocab_size}}")
    for name, grid in study.grids.items():
        for cell in grid.get("cells", []):
            if set(cell) - CELL_KEYS:
                raise ValueError(f"{path}: grid {name}: unknown cell keys {sorted(set(cell) - CELL_KEYS)}")
            for key, known in (("data", study.data), ("models", study.models), ("equal_compute", study.models)):
                missing = [v for v in cell.get(key, []) if v not in known]
                if missing:
                    raise ValueError(f"{path}: grid {name}: {key} {missing} not declared")
    return study


def flag_list(flags: Dict[str, Any], root: Path) -> List[str]:
    """{"passes": 2, "pass-phases": None} → ["--passes", "2", "--pass-phases", "null"]."""
    out = []
    for key, value in flags.items():
        if isinstance(value, str):
            text = value.replace("{root}", str(root))
        elif value is None or isinstance(value, (bool, list, dict)):
            text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
        else:
            text = str(value)
        out += [f"--{key}", text]
    return out


def parse_recipe(recipe: Path, flags: List[str]):
    """The recipe a run of these flags trains with (the entry point's own flag parser)."""
    from fbt_megatron.recipe import flags as flag_parser

    return flag_parser.parse(["--recipe", str(recipe), *flags], prog="study", description="")


def expected_steps(recipe) -> Dict[int, float]:
    """{k: the expected number of steps with k passes} over the recipe's run (its pass schedule)."""
    iters, phases = recipe.training.train_iters, recipe.pass_phases()
    out: Dict[int, float] = {}
    for (start, mixture), end in zip(phases, [p[0] for p in phases[1:]] + [iters]):
        for k, w in mixture.items():
            out[k] = out.get(k, 0.0) + (end - start) * w / sum(mixture.values())
    return out


def mean_passes(recipe) -> float:
    """k̄: the expected passes per step of the recipe's pass schedule, over its whole run."""
    return sum(k * n for k, n in expected_steps(recipe).items()) / recipe.training.train_iters


def _length_name(epochs: Optional[float], steps: Optional[int], compute_of: Optional[str]) -> str:
    if epochs is not None:
        return f"e{epochs:g}" + (f"x{compute_of}" if compute_of else "")
    return f"s{steps}" if steps is not None else "recipe"


def expand(study: Study, grid: str, root: Path, subset_tokens: Optional[Dict[str, int]] = None) -> List[RunSpec]:
    """The runs of ``grid`` in its order (cells first to last, all seeds of a cell together: a grid
    stopped early has whole cells). Epochs need
    ``subset_tokens`` ({data: tokens in its train split})."""
    g = study.grid(grid)
    seeds, threads = g.get("seeds", [1234]), g.get("threads", [1])
    model_recipe = {m: REPO / spec["recipe"] for m, spec in study.models.items()}
    parsed: Dict[tuple, Any] = {}

    def recipe_of(model: str, data: Optional[str] = None):
        """The recipe of a model's runs on ``data`` (every flag but the run's own), parsed once."""
        if (model, data) not in parsed:
            parsed[model, data] = parse_recipe(model_recipe[model], common_flags(study, model, data, root))
        return parsed[model, data]

    runs = []
    for cell in g.get("cells", []):
        lengths = [(e, None) for e in cell.get("epochs", [])] + [(None, s) for s in cell.get("steps", [])] or [(None, None)]
        for data, model, (epochs, steps), compute_of, thread_count, seed in itertools.product(
                cell["data"], cell["models"], lengths, cell.get("equal_compute", [None]), threads, seeds):
            runs.append(_run(study, root, data, model, epochs, steps, compute_of, seed, thread_count,
                             model_recipe[model], recipe_of, subset_tokens or {}))
    seen = set()
    unique = [r for r in runs if not (r.folder in seen or seen.add(r.folder))]
    return unique


def common_flags(study: Study, model: str, data: Optional[str], root: Path) -> List[str]:
    """The flags every run of ``model`` on ``data`` has: the study's, the model's, the data's."""
    data_spec = study.data[data] if data else {}
    flags = flag_list({**study.flags, **study.models[model].get("flags", {}), **data_spec.get("flags", {})}, root)
    if "subset_tokens" in data_spec:
        flags += ["--data-path", str(study.subset_folder(root, data)), "--corpus", "null"]
    return flags


def _run(study, root, data, model, epochs, steps, compute_of, seed, threads, recipe_path, recipe_of, subset_tokens) -> RunSpec:
    data_spec = study.data[data]
    recipe = recipe_of(model, data)
    flags = common_flags(study, model, data, root)
    run_epochs = None
    if epochs is not None:
        if "subset_tokens" not in data_spec:
            raise ValueError(f"{study.path}: epochs need data with subset_tokens ({data} has none); give steps")
        run_epochs = epochs * (mean_passes(recipe_of(compute_of)) if compute_of else 1.0)
        per_step = recipe.training.global_batch_size * recipe.data.seq_length
        steps = max(1, round(run_epochs * subset_tokens[data] / per_step))
    steps = steps or recipe.training.train_iters
    every = recipe.logging.log_interval  # validations at a multiple of the log interval: each on a logged step
    interval = every * max(1, math.ceil(steps / study.validations / every))
    length = _length_name(epochs, None if epochs is not None else steps, compute_of)
    folder = study.run_folder(root, data, model, length, seed, threads)
    flags += ["--seed", str(seed), "--threads", str(threads), "--train-iters", str(steps),
              "--eval-interval", str(interval), "--save-interval", str(interval), "--keep-last-n-checkpoints", "1",
              "--data-cache-path", str(folder / "data_cache")]
    recipe = copy.deepcopy(recipe)
    recipe.training.train_iters = steps
    return RunSpec(study.name, data, model, length, seed, threads, folder, recipe_path, tuple(flags), steps,
                   run_epochs, mean_passes(recipe), compute_of, study.evaluate)


def subset_tokens_needed(study: Study, grid: str) -> List[str]:
    """The subsets ``grid`` trains on."""
    names = {d for cell in study.grid(grid).get("cells", []) for d in cell["data"]}
    return sorted(d for d in names if "subset_tokens" in study.data[d])
