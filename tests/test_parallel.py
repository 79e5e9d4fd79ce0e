"""Every parallel layout computes what one process computes (real gloo processes, fp32).

* The equivalence matrix: for each layout, k ∈ {1, 2, 3} and recompute off / pass-level /
  megatron-core full / megatron-core selective / pass-level and full with their inputs offloaded
  to host memory, the per-pass losses of two steps, the first step's reduced gradients and the
  weights after the second step equal the single-process run's within 1e-5 relative.
* The SP/CP shift of the carried state equals the whole-sequence shift, values and gradients, on
  the simulated device (``tests/test_device_contracts.py``): its groups take device tensors only.
* The headwise gate at TP 2 (with and without SP) gives one process's logits and weight gradient,
  and under SP all-gathers only its logits (the normed input is the QKV linear's to gather).
* The entry point as forked ranks (torchrun's environment) logs the same losses at TP2×PP2 and PP2×DP2 as alone, and
  checkpoints move between layouts (TP2×PP2 → 1 process, 1 process → TP2×PP2, PP2×DP2 → 1).
"""

import json
import shutil
from pathlib import Path

import equivalence
import pytest
from equivalence import ENTRY, corpus_flags, worst_difference
from forked import run_commands
from helpers import launch

from fbt_megatron.model.config import PRESETS
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics
from fbt_megatron.trainer.passes import PassPhase, PassSchedule

DISTRIBUTED = Path(__file__).parent / "distributed"
LAYOUTS = {  # name: (processes, flags); the distributed optimizer is on by default
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "true"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp4": (4, ["--pipeline-model-parallel-size", "4"]),
    "dp2_distopt_overlap": (2, ["--overlap-grad-reduce", "true"]),
    "tp2_pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "tp2_dp2": (4, ["--tensor-model-parallel-size", "2", "--overlap-grad-reduce", "true"]),
    "pp2_dp2_overlap": (4, ["--pipeline-model-parallel-size", "2", "--overlap-grad-reduce", "true"]),
}
# Recompute modes per layout (default: the worker's six). Every mode runs at TP 2 + SP, PP 2 and DP 2
# (the parallel dimensions it interacts with); the combined layouts check the modes that cross them.
MODES = {
    "tp2_sp": ["none", "passes", "full", "selective", "offload"],
    "pp4": ["none", "passes", "offload"],
    "tp2_pp2": ["none", "passes", "full"],
    "tp2_dp2": ["none", "passes"],
    "pp2_dp2_overlap": ["none", "passes", "full"],
}
TOLERANCE = 1e-5


# ---------------------------------------------------------------- the equivalence matrix
class Runs:
    """Runs of tests/distributed/equivalence_worker.py in one folder, all from one seed checkpoint.
    The layouts of one world size run in one launch of forked ranks (start-up paid once), on first use."""

    def __init__(self, root: Path, corpus):
        self.root, self.corpus, self.launched = root, corpus, set()

    def run(self, name: str, nproc: int, layouts: dict, *extra) -> Path:
        """Launch ``layouts`` ({name: (flags, modes or None)}) with ``nproc`` processes; ``name`` the log's."""
        spec = [{"out": str(self.root / n), "flags": flags, "modes": modes} for n, (flags, modes) in layouts.items()]
        args = ["--corpus", Path(self.corpus.train_prefix).parent, "--seed-checkpoint", self.root / "seed", "--layouts", json.dumps(spec)]
        code, text = launch(self.root / f"{name}.log", DISTRIBUTED / "equivalence_worker.py", *args, *extra, nproc=nproc)
        assert code == 0, text[-4000:]
        return self.root / name

    def layout(self, name: str) -> Path:
        """The results of a layout of LAYOUTS, launched with every layout of its world size."""
        nproc = LAYOUTS[name][0]
        if nproc not in self.launched:
            self.run(f"world{nproc}", nproc, {n: (f, MODES.get(n)) for n, (p, f) in LAYOUTS.items() if p == nproc})
            self.launched.add(nproc)
        return self.root / name


@pytest.fixture(scope="module")
def runs(small_corpus, tmp_path_factory):
    """The single-process reference run; it also writes the seed checkpoint."""
    runs = Runs(tmp_path_factory.mktemp("equivalence"), small_corpus)
    runs.run("single", 1, {"single": ([], None)}, "--create-seed")
    check_offloaded_bytes(runs.root / "single", 1, [])
    return runs


@pytest.mark.slow
def test_reference_is_deterministic_and_not_vacuous(runs):
    """Same seed and config → the same numbers; the steps move the weights; passes differ."""
    again = runs.run("single_again", 1, {"single_again": ([], ["none"])}, "--passes", "3")
    assert all(v == 0 for worst in equivalence.compare(runs.root / "single", again).values() for v in worst.values())
    model_args = json.loads((runs.root / "single" / "model.json").read_text())
    before = equivalence.tensors(runs.root / "seed" / "iter_0000000", model_args)
    after = equivalence.tensors(again / "none_k3", model_args, "params.")
    assert max(equivalence.relative(before[name], after[name]) for name in before) > 1e-3
    assert len(set(json.loads((again / "losses.json").read_text())["none_k3"][0])) == 3


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_equals_single_process(layout, runs):
    nproc, flags = LAYOUTS[layout]
    modes = MODES.get(layout)
    result = equivalence.compare(runs.root / "single", runs.layout(layout))
    for trial, worst in sorted(result.items()):
        print(f"{layout:20s} {trial:9s} " + "  ".join(f"{kind} {value:.1e}" for kind, value in worst.items()))
    assert len(result) == 3 * (len(modes) if modes else 6)  # recompute modes × k = 1, 2, 3
    assert all(value <= TOLERANCE for worst in result.values() for value in worst.values()), result
    if "--overlap-grad-reduce" in flags:  # every bucket's reduction started inside the backward
        launches = json.loads((runs.root / layout / "overlap.json").read_text())
        assert all(starts and all(starts) for starts in launches.values()), launches
    check_offloaded_bytes(runs.root / layout, nproc, flags)


def flag(flags, name, default=1):
    return int(flags[flags.index(name) + 1]) if name in flags else default


def check_offloaded_bytes(folder: Path, nproc: int, flags: list):
    """Every rank offloaded exactly the recompute inputs that wait on its device: pass-level, e_t of
    every recomputed pass on the first stage and s^{(j−1)} unless a pipeline schedule holds it; full,
    every layer's input but a later stage's received one (also held by the schedule); nothing
    otherwise. Pass-level recompute skips the passes whose backward follows at once: pass k on the
    last stage (PP = 1: the only stage; 1F1B runs pass k's backward right after its forward there),
    so a layer runs k·M forwards and k·M recomputes per step, M fewer on the last stage."""
    tp, pp = flag(flags, "--tensor-model-parallel-size"), flag(flags, "--pipeline-model-parallel-size")
    rows = 64 // tp if "--sequence-parallel" in flags else 64  # the worker's --seq-length 64
    microbatches = 8 // (2 * (nproc // (tp * pp)))  # global batch 8, micro batch 2, per DP rank
    tensor_bytes = rows * 2 * PRESETS["tiny"]["hidden_size"] * 4  # [rows, micro batch 2, h] fp32
    for stage in json.loads((folder / "offload.json").read_text()):
        first = stage["pp_rank"] == 0
        for trial, got in stage["bytes"].items():
            mode, k = trial.rsplit("_k", 1)
            k = int(k)
            per_microbatch = {
                # PP = 1: pass k is not recomputed, so e_t of passes j < k and s^{(j−1)} of 1 < j < k
                "offload": ((k - 1) + max(k - 2, 0) if pp == 1 else k) if first else 0,
                "full_offload": k * (stage["layers"] - (0 if first else 1)),
            }.get(mode, 0)
            assert got == 2 * microbatches * per_microbatch * tensor_bytes, (trial, stage)
            last = stage["pp_rank"] == pp - 1
            recomputes = {"passes": k - last, "offload": k - last, "full": k, "full_offload": k}.get(mode, 0)
            assert stage["layer_calls"][trial] == 2 * microbatches * (k + recomputes), (trial, stage)


# ---------------------------------------------------------------- the shift across shards
@pytest.mark.slow
@pytest.mark.parametrize("sp", ["sp", "no-sp"])
def test_the_headwise_gate_gathers_its_logits_not_its_input(sp, tmp_path):
    code, text = launch(tmp_path / "gate.log", DISTRIBUTED / "gate_worker.py", sp, nproc=2)
    verdicts = [line for line in text.splitlines() if line.startswith("check ")]
    assert code == 0 and len(verdicts) == 2 * 3, text[-3000:]
    assert all(line.endswith(": ok") for line in verdicts), "\n".join(verdicts)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,layouts", [(2, ["2,1", "1,2"]), (4, ["1,4", "2,2"])])  # (TP, CP) layouts per launch
def test_sharded_shift_equals_whole_sequence_shift(nproc, layouts, tmp_path, monkeypatch):
    monkeypatch.setenv("FBT_SIMULATED_DEVICE", "1")  # TP and CP groups take device tensors only, as on NCCL
    code, text = launch(tmp_path / "shift.log", DISTRIBUTED / "sequence_worker.py", *(f"--layout={x}" for x in layouts), nproc=nproc)
    assert code == 0, text[-3000:]
    for layout in layouts:
        tp, cp = layout.split(",")
        assert text.count(f"tp {tp} cp {cp}: rows") == nproc
    assert text.count("value error 0.0 grad error 0.0") == nproc * len(layouts)
    assert text.count("host-device copies in a second pass: []") == nproc * len(layouts), text[-3000:]  # indices on the device


# ---------------------------------------------------------------- the entry point at every layout
ENTRY_LAYOUTS = {
    "single": (1, []),
    # the entry point's own wiring (data per DP rank, logged reductions, validation, checkpoints) at
    # TP × PP and at DP (distributed optimizer, overlapped reduction) × PP; every layout's numerics
    # are the equivalence matrix's
    "tp2_pp2": LAYOUTS["tp2_pp2"],
    "pp2_dp2_overlap": LAYOUTS["pp2_dp2_overlap"],  # k changes between steps: per-k overlap bookkeeping
}


class EntryRuns:
    """``python -m fbt_megatron.train`` as forked ranks (tests/forked.py), every run starting from one seed checkpoint.
    One-process runs are forked from one interpreter (tests/forked.py): the seed checkpoint and the
    uninterrupted one-process run together."""

    def __init__(self, root: Path, corpus):
        self.root, self.flags, self.done = root, [*ENTRY, *corpus_flags(corpus)], {}
        single = ["--load", root / "seed", "--save", root / "single"]
        self.alone([("seed", ["--save", root / "seed", "--create-seed-checkpoint", "true"]), ("single", single)])
        self.done["single"] = read_metrics(root / "single")

    def alone(self, runs: list) -> None:
        """(name, flags) runs, one process each, one after another."""
        commands = [([*self.flags, *flags], self.root / f"{name}.log", None) for name, flags in runs]
        for code, (name, _) in zip(run_commands("fbt_megatron.train", commands), runs):
            assert code == 0, (self.root / f"{name}.log").read_text()[-4000:]

    def launch(self, name: str, nproc: int, *flags) -> Path:
        if nproc == 1:
            self.alone([(name, flags)])
        else:
            code, text = launch(self.root / f"{name}.log", "-m", "fbt_megatron.train", *self.flags, *flags, nproc=nproc)
            assert code == 0, text[-4000:]
        return self.root / name

    def layout(self, name: str) -> list:
        """The records of an uninterrupted run at a layout (run once)."""
        if name not in self.done:
            nproc, flags = ENTRY_LAYOUTS[name]
            self.done[name] = read_metrics(self.launch(name, nproc, *flags, "--load", self.root / "seed", "--save", self.root / name))
        return self.done[name]

    def resume(self, source: str, target: str, iteration: int) -> list:
        """Records of a run resumed at layout ``target`` from ``source``'s checkpoint ``iteration``."""
        self.layout(source)
        folder = self.root / f"{source}_to_{target}"
        name = f"iter_{iteration:07d}"
        shutil.copytree(self.root / source / name, folder / name)
        (folder / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
        nproc, flags = ENTRY_LAYOUTS[target]
        return read_metrics(self.launch(folder.name, nproc, *flags, "--load", folder, "--save", folder))


@pytest.fixture(scope="module")
def entry(small_corpus, tmp_path_factory):
    return EntryRuns(tmp_path_factory.mktemp("entry"), small_corpus)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name in ENTRY_LAYOUTS if name != "single"])
def test_entry_point_logs_the_same_losses_at_every_layout(layout, entry):
    single = entry.layout("single")
    assert {r["k"] for r in single} == {1, 2, 3}
    mixture = (PassPhase(0, {1: 0.4, 2: 0.3, 3: 0.3}),)
    assert [r["k"] for r in single] == [PassSchedule(1234, mixture)(i) for i in range(6)]
    worst = worst_difference(single, entry.layout(layout))
    print(f"entry point, {layout} vs one process, 6 steps (k = {[r['k'] for r in single]}): worst relative difference {worst:.1e}")
    assert worst <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("source,target", [("tp2_pp2", "single"), ("single", "tp2_pp2"), ("pp2_dp2_overlap", "single")])
def test_checkpoint_resumes_at_another_layout(source, target, entry):
    """Saved at step 3 under one layout, resumed under another: steps 4–6 as uninterrupted."""
    resumed = entry.resume(source, target, 3)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    versus_source = worst_difference(entry.layout(source)[3:], resumed)
    versus_target = worst_difference(entry.layout(target)[3:], resumed)
    print(f"resume {source} → {target}: vs uninterrupted {source} {versus_source:.1e}, vs uninterrupted {target} {versus_target:.1e}")
    assert versus_source <= 1e-6 and versus_target <= 1e-6
