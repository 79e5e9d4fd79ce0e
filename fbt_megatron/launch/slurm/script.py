"""Job scripts from the templates in slurm/ (plain bash with ``{{name}}`` placeholders): what a
training job runs (``Stage``), where and for how long (``Resources``), and ``render``, which fills
every placeholder with a value shell-quoted here and refuses a template naming a value it was not
given."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from fbt_megatron.recipe import Recipe, RecipeError

REPOSITORY = Path(__file__).resolve().parents[3]  # the checkout whose code the jobs run (on PYTHONPATH)
TEMPLATES = REPOSITORY / "slurm"
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


STOP_RESERVE = 20  # seconds the job script needs, after the training stopped, before the time limit (attempts.py, the requeue)


def stop_seconds(signal_seconds: int) -> int:
    """How long torchrun's workers get from the time-limit SIGTERM to save and exit (``--stop-timeout``):
    the signal margin less ``STOP_RESERVE``, so that the job script still requeues the job before Slurm
    ends it at the limit (a job that reaches its limit is not requeued)."""
    return signal_seconds - STOP_RESERVE


def device_connections(config: Recipe) -> str:
    """The job's CUDA_DEVICE_MAX_CONNECTIONS line. 1 (kept when the submitting shell exports another
    value) with tensor or context parallelism: megatron-core relies on one hardware queue to issue a
    tensor-parallel layer's asynchronous all-gather, reduce-scatter or all-reduce before the GEMM it
    overlaps with (``tensor_parallel/layers.py``, core_v0.16.1 and core_v0.19.0: a speedup, not
    correctness; it warns without it), and Megatron-LM's own training refuses TP or CP > 1 without it
    on GPUs before Blackwell (``megatron/training/arguments.py``, core_v0.19.0). Else unset: nothing of
    megatron-core needs it, and one queue would serialise side streams with compute (``offload.py``'s
    copies)."""
    p = config.parallel
    if p.tensor_model_parallel_size > 1 or p.context_parallel_size > 1:
        return (f"export CUDA_DEVICE_MAX_CONNECTIONS=${{CUDA_DEVICE_MAX_CONNECTIONS:-1}}  # TP {p.tensor_model_parallel_size}, "
                f"CP {p.context_parallel_size}")
    return "# (TP 1, CP 1: CUDA_DEVICE_MAX_CONNECTIONS not set)"


SERVE_CPU_KV_CACHE = "1G"  # vllm serve's KV cache on a CPU node (docs/serving.md's serve line)
CPUS_PER_GPU = 8  # CPUs per GPU of a one-task job (export + evaluation, serving) without --cpus-per-task


@dataclass
class Resources:
    """Where and how long a job runs: the #SBATCH options, container and environment every job of
    a submission shares."""

    nodes: int
    gpus_per_node: int  # 0: CPU, one process per node and no GRES
    time: str
    partition: Optional[str] = None
    account: Optional[str] = None
    container_image: Optional[str] = None
    container_runtime: str = "pyxis"  # CONTAINER_RUNTIMES
    log_dir: Path = Path("logs")
    container_mounts: List[str] = field(default_factory=list)  # SRC:DST[:FLAGS] beyond the work folder
    sbatch_lines: List[str] = field(default_factory=list)  # extra #SBATCH options, written after ours
    environment: Dict[str, str] = field(default_factory=dict)  # exported in the job after the defaults
    cpus_per_task: Optional[int] = None  # None: training jobs take whole nodes (--exclusive)
    exclusive: bool = True
    cpu_procs_per_node: int = 1  # training processes per CPU node (--gpus-per-node 0)

    @property
    def procs_per_node(self) -> int:
        """Training processes per node: one per GPU, or cpu_procs_per_node on CPU nodes."""
        return self.gpus_per_node or self.cpu_procs_per_node

    def options(self, gpus: Optional[int] = None, cpus_per_task: Optional[int] = None, exclusive: Optional[bool] = None) -> str:
        """#SBATCH lines: partition, account, GPUs per node, CPUs (whole nodes and/or CPUs per task),
        then the extra lines given; the defaults are a training job's (``gpus``, ``cpus_per_task``,
        ``exclusive``: another job's)."""
        gpus = self.gpus_per_node if gpus is None else gpus
        cpus = self.cpus_per_task if cpus_per_task is None else cpus_per_task
        exclusive = self.exclusive if exclusive is None else exclusive
        lines = [f"#SBATCH --{key}={value}" for key, value in
                 (("partition", self.partition), ("account", self.account), ("gpus-per-node", gpus or None),
                  ("cpus-per-task", cpus)) if value]
        lines += ["#SBATCH --exclusive"] if exclusive else []
        return "\n".join(lines + [f"#SBATCH {line}" for line in self.sbatch_lines])

    def one_task_options(self) -> str:
        """#SBATCH lines of a one-task job on one node (export + evaluation, serving): its GPUs with
        --cpus-per-task or CPUS_PER_GPU CPUs each, or the whole node on CPU (``--gpus-per-node 0``)."""
        gpus = self.gpus_per_node
        return self.options(cpus_per_task=self.cpus_per_task or CPUS_PER_GPU * gpus or None, exclusive=not gpus)

    def container(self, workdir: Path, name: Optional[str] = None) -> str:
        """What goes between srun's options and the command when a container image is given: pyxis's
        options, or Apptainer's ``apptainer exec`` (its GPUs with ``--nv``) and the image. The work folder
        and this checkout are mounted at their own paths, then the mounts given. With pyxis and ``name``
        (a shell word, expanded by the job), the container pyxis keeps under that name for the job's
        later steps; Apptainer runs a .sif file in place, with nothing to keep."""
        if not self.container_image:
            return ""
        mounts = ",".join([*(f"{path}:{path}" for path in self.own_mounts(workdir)), *self.container_mounts])
        if self.container_runtime == "apptainer":
            return shlex.join(["apptainer", "exec", *(["--nv"] if self.gpus_per_node else []), "--bind", mounts,
                               "--pwd", str(workdir), self.container_image])
        options = shlex.join([f"--container-image={self.container_image}", f"--container-mounts={mounts}",
                              f"--container-workdir={workdir}"])
        return options + (f" --container-name={name}" if name else "")

    @staticmethod
    def own_mounts(workdir: Path) -> List[Path]:
        """The folders every container job mounts at their own paths: the work folder and this checkout."""
        return [workdir] + ([] if REPOSITORY.is_relative_to(workdir) else [REPOSITORY])

    def mounted(self, workdir: Path) -> List[Path]:
        """The folders a container sees at their host paths: its own mounts and each ``--container-mounts``
        whose destination is its source (``SRC`` alone, or ``SRC:SRC[:FLAGS]``)."""
        given = [mount.split(":") for mount in self.container_mounts]
        return self.own_mounts(workdir) + [workdir / parts[0] for parts in given if len(parts) == 1 or parts[0] == parts[1]]

    @property
    def pyxis(self) -> bool:
        """Whether pyxis runs the image (and keeps a named container per node and attempt)."""
        return bool(self.container_image) and self.container_runtime == "pyxis"

    def python(self, python: str) -> str:
        """The interpreter a job runs: this one, or the container's ``python``."""
        return "python" if self.container_image else shlex.quote(python)

    def exports(self) -> str:
        """The ``--env NAME=VALUE`` lines of the job script (after its defaults: they win)."""
        return "\n".join(f"export {name}={shlex.quote(value)}" for name, value in self.environment.items())


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
    config: Optional[Recipe] = None  # the recipe with its flags applied (what the job's training runs)

    def train_args(self) -> List[str]:
        args = ["--recipe", self.recipe, *self.flags, "--save", str(self.save), "--load", str(self.save)]
        return args + (["--pretrained-checkpoint", str(self.pretrained)] if self.pretrained else [])


def image_check(stage: Stage, res: Resources) -> str:
    """The training job's first step, run in the job's Python (the image's, or this one): ``image_check.py``
    (by its path) and its arguments: what the stage needs depends on GPU nodes and context parallelism;
    on GPU nodes CUDA must also initialise and show the job's GPUs per node (``--gpus N``)."""
    args = [*(["--image", res.container_image] if res.container_image else []),
            *(["--gpus", str(res.gpus_per_node)] if res.gpus_per_node else []),
            *(["--context-parallel"] if stage.config.parallel.context_parallel_size > 1 else [])]
    return quoted([REPOSITORY / "fbt_megatron" / "launch" / "slurm" / "image_check.py", *args])


# pyxis's name of a training job's container (slurm/train.sbatch): the job's steps of one attempt share it; a
# requeued attempt (a new restart count) imports the image afresh, never reusing a container an earlier one left.
CONTAINER_NAME = '"fbt-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"'
CONTAINER_RUNTIMES = ("pyxis", "apptainer")


def check_tasks(res: Resources) -> str:
    """srun's tasks of the environment check: one on every node with a container image (each node
    imports it there, before the training's rendezvous starts its clock) or GPUs (each node's driver
    and GPUs); else, the job's Python on CPU nodes, one on the first node."""
    if res.container_image or res.gpus_per_node:
        return '--nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1'
    return "--nodes=1 --ntasks=1"


# torchrun's c10d rendezvous: how long every node's agent has to join (torch's join_timeout, its default 600 s).
# IMAGE_IMPORT_ALLOWANCE: one node's pyxis import of a ~20 GB image at ~17 MB/s (a registry, or one file server
# for every node of the job; not measured): the check step imports it before the rendezvous, the training step
# only where that container is gone.
IMAGE_IMPORT_ALLOWANCE = 1200
JOIN_TIMEOUT = IMAGE_IMPORT_ALLOWANCE + 600  # s: 10 minutes more for the agents' start (--rdzv-join-timeout)


@dataclass(frozen=True)
class Retries:
    """What a training job does after an attempt failed (``launch/attempts.py``): with ``in_job``
    (torchrun launch), torchrun restarts the workers inside the allocation; then, or without it, the
    job is requeued, away from the failed node, and with ``exclude_stragglers`` away from the nodes
    the training named as stragglers too: at most ``max_restarts`` failures from one checkpoint.
    ``spare_nodes`` more nodes wait in torchrun's rendezvous to take a lost node's place."""
    max_restarts: int = 3
    exclude_stragglers: bool = False
    in_job: bool = True
    spare_nodes: int = 0  # allocated beyond the training's, waiting to replace a node lost (in_job, torchrun launch)

    def args(self) -> List[str]:
        return ["--max-restarts", str(self.max_restarts), *(["--exclude-stragglers"] if self.exclude_stragglers else []),
                *(["--in-job"] if self.in_job else [])]


def training_script(stage: Stage, res: Resources, launch: str, signal_seconds: int, workdir: Path, python: str,
                    retries: Retries, join_timeout: int = JOIN_TIMEOUT) -> str:
    """The job of one stage, requeued after a failure as ``retries`` says; with ``--launch torchrun``
    its rendezvous waits ``join_timeout`` seconds for every node."""
    procs = res.procs_per_node
    # the attempts' record and retry budget runs in the batch shell: outside a container, its python3
    attempts = ["python3" if res.container_image else res.python(python),
                shlex.quote(str(REPOSITORY / "fbt_megatron" / "launch" / "attempts.py"))]
    return render(
        "train.sbatch", name=stage.name, nodes=res.nodes + retries.spare_nodes, train_nodes=res.nodes, spares=retries.spare_nodes,
        spare_options="#SBATCH --no-kill" if retries.spare_nodes else "# (no spare nodes)",
        torchrun_kill="--no-kill" if retries.spare_nodes else "--kill-on-bad-exit=1",
        tasks_per_node=1 if launch == "torchrun" else procs,
        time=res.time, log_dir=shlex.quote(str(res.log_dir)), signal_seconds=signal_seconds, sbatch_options=res.options(),
        workdir=shlex.quote(str(workdir)), launch=launch, procs_per_node=procs, save=shlex.quote(str(stage.save)),
        train_iters=stage.train_iters, train_args=quoted(stage.train_args()),
        container_name=CONTAINER_NAME if res.pyxis else "''", container=res.container(workdir, '"$CONTAINER_NAME"'),
        python=res.python(python), environment=res.exports(), repository=shlex.quote(str(REPOSITORY)),
        policy=quoted(retries.args()), attempts=" ".join(attempts), image_check=image_check(stage, res), stop_seconds=stop_seconds(signal_seconds),
        device_connections=device_connections(stage.config), check_tasks=check_tasks(res), join_timeout=join_timeout,
        image=shlex.quote(res.container_image or ""),
    )


def export_eval_script(name: str, models: List[Path], exports: Path, results: Path, eval_args: List[str], res: Resources,
                       workdir: Path, python: str) -> str:
    """A job of ``python -m fbt_megatron.evaluation table``: run folders among ``models`` are exported into ``exports`` first;
    the table goes to ``results`` (after a chain: its last stage; ``evaluate``: the models given)."""
    return render(
        "export_eval.sbatch", name=name, time=res.time, log_dir=shlex.quote(str(res.log_dir)),
        sbatch_options=res.one_task_options(), workdir=shlex.quote(str(workdir)),
        container=res.container(workdir), python=res.python(python), environment=res.exports(),
        repository=shlex.quote(str(REPOSITORY)), models=quoted(models),
        exports=shlex.quote(str(exports)), results=shlex.quote(str(results)), eval_args=quoted(eval_args),
    )


def serve_script(name: str, export: Path, port: int, serve_args: List[str], res: Resources, workdir: Path,
                 python: str) -> str:
    """A job of ``vllm serve EXPORT`` (this package's vLLM plugin) on one node until its time limit:
    the ``vllm`` beside this Python, or the container's. On GPUs eager (no CUDA graphs, docs/serving.md);
    on a CPU node (``--gpus 0``) compiled, with a KV cache of ``SERVE_CPU_KV_CACHE`` (vLLM's CPU backend
    would reserve 92% of the node's RAM; a ``--kv-cache-memory-bytes`` after ``--`` wins)."""
    vllm = "vllm" if res.container_image else shlex.quote(str(Path(python).with_name("vllm")))
    engine_args = "--enforce-eager" if res.gpus_per_node else f"--kv-cache-memory-bytes {SERVE_CPU_KV_CACHE}"
    return render(
        "serve.sbatch", name=name, time=res.time, log_dir=shlex.quote(str(res.log_dir)),
        sbatch_options=res.one_task_options(), workdir=shlex.quote(str(workdir)), container=res.container(workdir),
        environment=res.exports(), repository=shlex.quote(str(REPOSITORY)), vllm=vllm, export=shlex.quote(str(export)),
        port=port, engine_args=engine_args, serve_args=quoted(serve_args),
    )
