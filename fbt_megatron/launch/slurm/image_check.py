"""The first step of a training job (slurm/train.sbatch): can the job's Python run the training? That
Python is the container image's (``--container-image``, started by pyxis as the training's tasks are),
or, without an image, the one the job was submitted with. It imports what the training needs and says
so in one line: the versions it found, or ``error:`` naming the image (or the Python), what did not
import and the fix, with exit code 2 (bad input: the job script ends the job there; not retried).

On a GPU node of the job (``--gpus N``, one task per node) it is also the node's health check: CUDA
must initialise (the node's driver against the image's CUDA), show the N GPUs the job asked for per
node and run a kernel on each; else one ``error:`` line names the node, what was found and the fix,
exit code 2. ``--gpu`` alone only imports (the image's build, which has no GPU, runs that).

Every job needs torch, megatron-core, and this project with everything its training imports
(``fbt_megatron.train``: the checkout is first on the job's PYTHONPATH). Transformer Engine
(``transformer_engine.pytorch``, what megatron-core's TE layers use) is needed on GPU nodes and by
context parallelism (TE attention) on any nodes; GPU nodes also need a CUDA build of torch. A CPU job
(``--gpus-per-node 0``) without context parallelism runs the local spec and does not need TE.

Plain Python, standard library only, run by its path (``python .../image_check.py``): it must be able
to say what is missing when that is torch itself.
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import sys
import warnings
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]  # run by path: its folder's modules (launch.py, script.py, ...) must not shadow top-level ones

BAD_INPUT = 2  # cli.py's exit code for bad input: slurm/train.sbatch ends the job, attempts.py would not retry it


def problems(gpu: bool, context_parallel: bool) -> list:
    """What stops this Python from running the training, one phrase each (none: it can)."""
    needs_te = [why for why, needed in (("on GPU nodes", gpu), ("by context parallelism", context_parallel)) if needed]
    modules = [("torch", ""), ("megatron.core", ""),
               *([("transformer_engine.pytorch", f", needed {' and '.join(needs_te)}")] if needs_te else []),
               ("fbt_megatron.train", "")]
    found, seen = [], set()
    for module, why in modules:
        try:
            with warnings.catch_warnings():  # megatron-core's notices of what it falls back from
                warnings.simplefilter("ignore")
                importlib.import_module(module)
        except Exception as e:  # ImportError, or a library failing as it loads (OSError: a missing CUDA library)
            reason = _reason(e)
            if reason not in seen:  # megatron.core's missing torch is torch's
                found.append(f"import {module} failed ({reason}){why}")
            seen.add(reason)
    torch = sys.modules.get("torch")
    if gpu and torch is not None and torch.version.cuda is None and torch.version.hip is None:
        found.append(f"its torch {torch.__version__} is a CPU-only build (GPU nodes need a CUDA one)")
    return found


def cuda_problem(torch, gpus: int, node: str) -> str:
    """What stops this node's GPUs from running the training, and its fix, one phrase ("": nothing):
    CUDA initialises, shows ``gpus`` GPUs, and a kernel runs on each."""
    keep_out = f"or keep the node out of the job (--sbatch-option=--exclude={node})"
    try:
        with warnings.catch_warnings():  # is_available's and device_count's warnings repeat init's error
            warnings.simplefilter("ignore")
            torch.cuda.init()  # the driver (or the image's CUDA compatibility libraries) against the image's CUDA
            found = torch.cuda.device_count()
    except Exception as e:  # RuntimeError: a driver too old, none, no GPU visible
        return (f"CUDA did not initialise ({_reason(e)}): the image's CUDA {torch.version.cuda} needs a driver that "
                f"supports it (its release notes): update the node's driver, give an image built for it, {keep_out}")
    if found != gpus:
        return (f"it shows {found} GPU{'' if found == 1 else 's'} where the job asked for {gpus} per node "
                f"(--gpus-per-node {gpus}): check its GPUs (nvidia-smi), {keep_out}")
    for index in range(found):
        try:
            if (torch.ones(1, device=f"cuda:{index}") + 1).item() != 2:  # a kernel, and its result back
                raise RuntimeError("1 + 1 was not 2")
        except Exception as e:  # no kernel image for this GPU's architecture, an ECC error, a fallen-off GPU
            return (f"a kernel on its GPU {index} failed ({_reason(e)}): an image without this GPU's architecture, or "
                    f"a faulty GPU: check it (nvidia-smi), {keep_out}")
    return ""


def _reason(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def versions() -> str:
    """The versions of what the training will use, for the job's log."""
    names = (("torch", "torch"), ("megatron.core", "megatron-core"), ("transformer_engine", "transformer-engine"))
    found = [f"{label} {getattr(sys.modules[module], '__version__', '?')}" for module, label in names if module in sys.modules]
    torch = sys.modules["torch"]
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
    return f"python {sys.version.split()[0]}, " + ", ".join(found) + f" ({cuda})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", help="the job's --container-image (none: the job runs this Python)")
    p.add_argument("--gpu", action="store_true", help="the job's nodes have GPUs: a CUDA torch and Transformer Engine")
    p.add_argument("--gpus", type=int, metavar="N", help="on a GPU node of the job: also CUDA initialises, shows N GPUs "
                   "(the job's per node) and runs a kernel on each (implies --gpu)")
    p.add_argument("--context-parallel", action="store_true", help="the job uses context parallelism: Transformer Engine")
    args = p.parse_args(argv)
    where = f"--container-image {args.image}" if args.image else f"the job's Python {sys.executable}"
    found = problems(args.gpu or args.gpus is not None, args.context_parallel)
    if found:
        fix = ("build the project's image from an NGC PyTorch image (packaging/container/Dockerfile, docs/gpu.md#the-container) "
               "and give that" if args.image else "give --container-image with the project's image "
               "(packaging/container/Dockerfile, docs/gpu.md#the-container), or submit from a Python that has them")
        print(f"error: {where} cannot run this job: {'; '.join(found)}: {fix}", file=sys.stderr, flush=True)
        return BAD_INPUT
    gpus = ""
    if args.gpus is not None:
        torch, node = sys.modules["torch"], os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        problem = cuda_problem(torch, args.gpus, node)
        if problem:
            print(f"error: {where} on node {node} cannot run this job: {problem}", file=sys.stderr, flush=True)
            return BAD_INPUT
        gpus = f"; {args.gpus} × {torch.cuda.get_device_name(0)} per node"
    print(f"=== environment: {where}: {versions()}{gpus} ===", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
