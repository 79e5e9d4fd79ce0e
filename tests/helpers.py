import torch

from fbt_megatron.common.processes import outside_group
from fbt_megatron.model.config import make_config
from fbt_megatron.model.fbt_model import FBTModel


def build(seed=0, **overrides):
    """A tiny FBT model (fp32, CPU) with fresh random weights from `seed`."""
    torch.manual_seed(seed)
    config = make_config("tiny", **overrides)
    model = FBTModel(config)
    # give the norms non-trivial weights so that a missing/misplaced norm is visible
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def tokens(batch=2, seq=24, vocab=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


def launch(log, *args, nproc=None):
    """Run ``python -m <args>`` — with ``nproc``: ``<args>`` (a script or ``-m module``) as
    ``nproc`` ranks forked from one interpreter (tests/forked.py's ``run_ranks``, torchrun's
    environment) — from the repository root with tests/ importable; output goes to a file (helper
    processes of a crashed worker could hold a pipe open). Returns (exit code, output)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if nproc is not None:
        from forked import run_ranks

        return run_ranks(args, nproc, log), Path(log).read_text()
    root = Path(__file__).parent.parent
    env = outside_group()
    env["PYTHONPATH"] = os.pathsep.join([str(root / "tests"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", *map(str, args)]
    with open(log, "w") as out:
        run = subprocess.run(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900)
    return run.returncode, Path(log).read_text()
