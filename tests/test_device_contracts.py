"""Device contracts on a CPU: what CUDA + NCCL refuse, refused here too.

The rest of the suite computes on the host and runs every collective on gloo, which takes any
tensor: a host tensor sent to a tensor-parallel all-gather passes there and crashes on NCCL. Under
``FBT_SIMULATED_DEVICE=1`` (``fbt_megatron.common.simulated_device``) the compute device is ``fakegpu``, a
device that is not the host, and every group made from the default backend (TP, CP, PP, DP, the
distributed optimizer's, NorMuon's owner gather) takes its tensors only, failing in torch's own
device check with NCCL's error otherwise; gloo groups keep host tensors.

* The stand-in itself: it refuses a host tensor on a device group, a device tensor on a gloo group
  and a kernel mixing the two, and computes what gloo computes.
* The training entry point at TP 2 + SP, PP 2, DP 2 (distributed optimizer, overlapped gradient
  reduction) and TP 2 + SP with NorMuon, on the simulated device, logs the losses of one CPU process
  from the same seed checkpoint, saving checkpoints on the way. (Under today's ``sequence.py`` the
  first microbatch at TP 2 + SP gathered a host tensor on the TP group: it fails here.)
* Context parallelism (its entry point needs Transformer Engine's attention, GPU only): the sequence
  layout's shift and the loss shares that CP sends over its group, on the device
  (``tests/test_parallel.py``'s shift test runs under the simulated device).
"""

from pathlib import Path

import pytest
from equivalence import ENTRY, corpus_flags, worst_difference
from forked import run_commands
from helpers import launch

from fbt_megatron.trainer.metrics import read_metrics

DISTRIBUTED = Path(__file__).parent / "distributed"
SIMULATED = "FBT_SIMULATED_DEVICE"
LAYOUTS = {  # name: (processes, flags, the one-process reference)
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "true"], "adam"),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"], "adam"),
    "dp2_distopt_overlap": (2, ["--use-distributed-optimizer", "true", "--overlap-grad-reduce", "true"], "adam"),
    "tp2_sp_normuon": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "true", "--optimizer", "normuon"], "normuon"),
}
OPTIMIZERS = {"adam": [], "normuon": ["--optimizer", "normuon"]}
TOLERANCE = 1e-5


@pytest.mark.slow
def test_the_simulated_device_refuses_what_nccl_and_cuda_refuse(tmp_path, monkeypatch):
    monkeypatch.setenv(SIMULATED, "1")
    code, text = launch(tmp_path / "device.log", DISTRIBUTED / "simulated_device_worker.py", nproc=2)
    verdicts = [line for line in text.splitlines() if " check " in line]
    assert code == 0 and len(verdicts) == 2 * 14, text[-3000:]
    assert all(line.endswith(": ok") for line in verdicts), "\n".join(verdicts)


@pytest.fixture(scope="module")
def references(small_corpus, tmp_path_factory):
    """One CPU process per optimizer from one seed checkpoint: (root, flags, {optimizer: records})."""
    root = tmp_path_factory.mktemp("contracts")
    flags = [*ENTRY, *corpus_flags(small_corpus), "--override-opt-param-scheduler"]
    runs = [("seed", ["--save", root / "seed", "--create-seed-checkpoint", "true"])]
    runs += [(name, ["--load", root / "seed", "--save", root / name, *extra]) for name, extra in OPTIMIZERS.items()]
    commands = [([*flags, *extra], root / f"{name}.log", None) for name, extra in runs]
    for code, (name, _) in zip(run_commands("fbt_megatron.train", commands), runs):
        assert code == 0, (root / f"{name}.log").read_text()[-3000:]
    return root, flags, {name: read_metrics(root / name) for name in OPTIMIZERS}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_entry_point_on_a_device_that_is_not_the_host(layout, references, monkeypatch):
    root, flags, reference = references
    nproc, layout_flags, optimizer = LAYOUTS[layout]
    monkeypatch.setenv(SIMULATED, "1")
    save = root / f"simulated_{layout}"
    code, text = launch(root / f"{layout}.log", "-m", "fbt_megatron.train", *flags, *layout_flags,
                        "--load", root / "seed", "--save", save, nproc=nproc)
    assert code == 0, text[-4000:]
    assert "(tp " in text and sorted(p.name for p in save.glob("iter_*")) == ["iter_0000003", "iter_0000006"]
    worst = worst_difference(reference[optimizer], read_metrics(save))
    print(f"{layout} on the simulated device vs one CPU process: worst relative difference {worst:.1e}")
    assert worst <= TOLERANCE
