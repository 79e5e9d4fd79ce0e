"""The k-pass step on real gloo process groups equals the single-process run of the same
weights (loaded through megatron-core dist_checkpointing, resharded to the layout)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tokens

WORKER = Path(__file__).parent / "distributed" / "multipass_worker.py"


def torchrun(nproc, log, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone", str(WORKER), *args]
    # output to a file, not a pipe: helper processes of a crashed worker could hold a pipe open
    with open(log, "w") as out:
        run = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600)
    assert run.returncode == 0, Path(log).read_text()[-4000:]


@pytest.mark.slow
def test_tensor_parallel_2_matches_single_process(tmp_path):
    x = tokens(batch=2, seq=32, seed=4)
    batch = {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones_like(x[:, 1:]), "seeds": torch.tensor([21, 22])}
    torch.save(batch, tmp_path / "batch.pt")
    (tmp_path / "ckpt").mkdir()
    common = ["--checkpoint", str(tmp_path / "ckpt"), "--batch", str(tmp_path / "batch.pt")]
    torchrun(1, tmp_path / "single.log", *common, "--save", "--out", str(tmp_path / "single.json"))
    torchrun(2, tmp_path / "tp2.log", *common, "--out", str(tmp_path / "tp2.json"), "--tensor-model-parallel-size", "2")
    expected = json.loads((tmp_path / "single.json").read_text())
    got = json.loads((tmp_path / "tp2.json").read_text())
    worst = 0.0
    for k in ("1", "2", "3"):
        for key in ("pass_losses", "state_deltas", "fusion_grad"):
            e, g = torch.tensor(expected[k][key]), torch.tensor(got[k][key])
            if e.numel():
                worst = max(worst, ((g - e).abs().max() / e.abs().max()).item())
    print(f"TP=2 vs one process, k = 1..3: worst relative difference {worst:.2e}")
    assert worst < 1e-5
    assert expected["3"]["pass_losses"][0] != expected["3"]["pass_losses"][2]  # the passes differ
