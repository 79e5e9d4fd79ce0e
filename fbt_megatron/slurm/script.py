"""Job scripts from the templates in slurm/ (plain bash with ``{{name}}`` placeholders): what a
training job runs (``Stage``), where and for how long (``Resources``), and ``render``, which fills
every placeholder with a value shell-quoted here and refuses a template naming a value it was not
given."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from fbt_megatron.recipe import RecipeError

TEMPLATES = Path(__file__).resolve().parents[2] / "slurm"
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
LAUNCHES = ("torchrun", "tasks")


def parse_time(text: str) -> int:
    """Seconds of a Slurm time limit given as [D-]HH:MM:SS."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d{1,2}):(\d{2}):(\d{2})", text)
    if not match or int(match[3]) > 59 or int(match[4]) > 59:
        raise RecipeError(f"--time {text}: expected HH:MM:SS (or D-HH:MM:SS), e.g. --time 04:00:00")
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total < 60:
        raise RecipeError(f"--time {text}: Slurm's shortest time limit is one minute (00:01:00)")
    return total


@dataclass
class Resources:
    """Where and how long a job runs: the #SBATCH options every job of a submission shares."""

    nodes: int
    gpus_per_node: int  # 0: CPU, one process per node and no GRES
    time: str
    partition: Optional[str] = None
    account: Optional[str] = None
    container_image: Optional[str] = None
    log_dir: Path = Path("logs")

    def options(self, gpus: Optional[int] = None) -> str:
        """#SBATCH lines for the partition, the account and the GPUs (``gpus``: another count per node)."""
        gpus = self.gpus_per_node if gpus is None else gpus
        lines = [f"#SBATCH --{key}={value}" for key, value in
                 (("partition", self.partition), ("account", self.account), ("gpus-per-node", gpus or None)) if value]
        return "\n".join(lines)

    def container(self, workdir: Path) -> str:
        """srun's pyxis options when a container image is given (the work folder mounted at its own path)."""
        if not self.container_image:
            return ""
        return shlex.join([f"--container-image={self.container_image}", f"--container-mounts={workdir}:{workdir}",
                           f"--container-workdir={workdir}"])

    def python(self, python: str) -> str:
        """The interpreter a job runs: this one, or the container's ``python``."""
        return "python" if self.container_image else shlex.quote(python)


def render(template: str, **values) -> str:
    """slurm/<template> with every {{name}} replaced by ``values[name]``."""
    text = (TEMPLATES / template).read_text()
    missing = sorted(set(_PLACEHOLDER.findall(text)) - set(values))
    if missing:
        raise RecipeError(f"slurm/{template} names values the submit tool does not give: {', '.join(missing)}")
    return _PLACEHOLDER.sub(lambda m: str(values[m[1]]), text)


def quoted(args: List[str]) -> str:
    return " ".join(shlex.quote(str(a)) for a in args)


@dataclass
class Stage:
    """One training job: a recipe with its flags, its own run folder (--save and --load), and the
    run folder whose weights start it (--pretrained-checkpoint), if any."""

    name: str
    recipe: str
    save: Path
    train_iters: int
    flags: List[str] = field(default_factory=list)
    pretrained: Optional[Path] = None

    def train_args(self) -> List[str]:
        args = ["--recipe", self.recipe, *self.flags, "--save", str(self.save), "--load", str(self.save)]
        return args + (["--pretrained-checkpoint", str(self.pretrained)] if self.pretrained else [])


def training_script(stage: Stage, res: Resources, launch: str, signal_seconds: int, workdir: Path, python: str) -> str:
    procs = max(res.gpus_per_node, 1)
    return render(
        "train.sbatch", name=stage.name, nodes=res.nodes, tasks_per_node=1 if launch == "torchrun" else procs,
        time=res.time, log_dir=shlex.quote(str(res.log_dir)), signal_seconds=signal_seconds, sbatch_options=res.options(),
        workdir=shlex.quote(str(workdir)), launch=launch, procs_per_node=procs, save=shlex.quote(str(stage.save)),
        train_iters=stage.train_iters, train_args=quoted(stage.train_args()), container=res.container(workdir),
        python=res.python(python),
    )


def export_eval_script(name: str, run: Path, runs_root: Path, eval_args: List[str], res: Resources, workdir: Path,
                       python: str) -> str:
    """The job after a chain: tools/eval.py exports ``run`` into <runs_root>/exports and writes
    its table to <runs_root>/eval/<run name>.md."""
    return render(
        "export_eval.sbatch", name=name, time=res.time, log_dir=shlex.quote(str(res.log_dir)),
        sbatch_options=res.options(gpus=min(res.gpus_per_node, 1)), workdir=shlex.quote(str(workdir)),
        container=res.container(workdir), python=res.python(python),
        eval_tool=shlex.quote(str(TEMPLATES.parent / "tools" / "eval.py")), run=shlex.quote(str(run)),
        exports=shlex.quote(str(runs_root / "exports")), results=shlex.quote(str(runs_root / "eval" / f"{run.name}.md")),
        eval_args=quoted(eval_args),
    )
