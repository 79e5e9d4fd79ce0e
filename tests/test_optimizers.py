"""NorMuon + Adam and AdamC weight decay (fbt_megatron.optimizers).

* NorMuon's update equals a straightforward implementation of the paper's algorithm written
  here, and pytorch-optimizer's NorMuon (whose Newton–Schulz it uses); at TP 2, with each matrix
  orthogonalised by one owner rank and shared out, every rank's shards equal the one-process
  update bit for bit (tests/distributed/normuon_worker.py).
* The split of parameters between NorMuon and Adam.
* Through the training entry point at TP 2 and TP 2 × DP 2 (one launch of forked ranks each,
  tests/distributed/optimizer_worker.py) and in one process (this one), from one seed checkpoint: every layout's losses and
  final weights equal one process's; a run stopped by --exit-interval and resumed with --load
  equals the uninterrupted one bit for bit; a TP 2 checkpoint resumes at TP 1; blockwise TP
  differs; the optimizer state per rank drops with DP (each parameter's state on one DP rank);
  each family's lr and weight decay follow the WSD and AdamC formulas.
"""

import functools
import json
import math
from pathlib import Path

import equivalence
import pytest
import torch
from helpers import build, launch

from fbt_megatron.optimizers import uses_normuon
from fbt_megatron.optimizers.normuon import NorMuon
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics

DISTRIBUTED = Path(__file__).parent / "distributed"
TOLERANCE = 1e-5


# ---------------------------------------------------------------- the update, one process
def straightforward_normuon(weight, grads, lr, wd, momentum=0.95, beta2=0.95, eps=1e-10):
    """The paper's algorithm, written out: the weight after one step per gradient."""
    w, m, v = weight.clone(), torch.zeros_like(weight), torch.zeros(weight.shape[0], 1)
    for g in grads:
        m = momentum * m + (1 - momentum) * g
        u = (1 - momentum) * g + momentum * m
        x = u.T if u.shape[0] > u.shape[1] else u
        x = x / x.norm()
        for _ in range(5):
            a = x @ x.T
            x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
        o = x.T if u.shape[0] > u.shape[1] else x
        v = beta2 * v + (1 - beta2) * (o * o).mean(dim=1, keepdim=True)
        n = o / (v.sqrt() + eps)
        n = n * o.norm() / (n.norm() + eps) * math.sqrt(max(1.0, o.shape[0] / o.shape[1]))
        w = w * (1 - lr * wd) - lr * n
    return w


def ours(weight, grads, lr, wd, **kwargs):
    p = torch.nn.Parameter(weight.clone())
    optimizer = NorMuon([p], lr=lr, weight_decay=wd, **kwargs)
    for g in grads:
        p.grad = g.clone()
        optimizer.step()
    return p.detach()


@pytest.mark.parametrize("shape", [(48, 16), (16, 40)])
def test_normuon_equals_straightforward_implementation(shape):
    gen = torch.Generator().manual_seed(0)
    weight, grads = torch.randn(shape, generator=gen), [torch.randn(shape, generator=gen) for _ in range(4)]
    expected = straightforward_normuon(weight, grads, lr=0.02, wd=0.1)
    assert torch.allclose(ours(weight, grads, lr=0.02, wd=0.1), expected, atol=1e-5)
    assert not torch.allclose(weight, expected, atol=1e-3)


def test_normuon_qkv_split_orthogonalises_q_k_v_separately():
    """A fused QKV weight (2 query groups of [Q 4 rows, K 2, V 2]) updates as its Q, K and V matrices would alone."""
    gen = torch.Generator().manual_seed(1)
    weight, grads = torch.randn(16, 12, generator=gen), [torch.randn(16, 12, generator=gen) for _ in range(3)]
    shapes = [4, 2, 2]
    p = torch.nn.Parameter(weight.clone())
    p.is_qkv = True
    optimizer = NorMuon([p], lr=0.02, weight_decay=0.1, qkv_split_shapes=shapes)
    for g in grads:
        p.grad = g.clone()
        optimizer.step()
    rows = torch.arange(16).view(2, 8)
    for part in (rows[:, :4], rows[:, 4:6], rows[:, 6:]):
        index = part.reshape(-1)
        expected = straightforward_normuon(weight[index], [g[index] for g in grads], lr=0.02, wd=0.1)
        assert torch.allclose(p.detach()[index], expected, atol=1e-5)


def test_normuon_equals_pytorch_optimizer(monkeypatch):
    """pytorch-optimizer's NorMuon (Newton–Schulz in fp32 as ours; a wide matrix, where the paper's
    √max(1, m/n) is 1 — pytorch-optimizer leaves that factor out)."""
    from pytorch_optimizer import NorMuon as LibraryNorMuon
    from pytorch_optimizer.optimizer.muon import normuon as library

    monkeypatch.setattr(library, "zero_power_via_newton_schulz_5",
                        functools.partial(library.zero_power_via_newton_schulz_5, dtype=torch.float32))
    gen = torch.Generator().manual_seed(2)
    weight, grads = torch.randn(24, 40, generator=gen), [torch.randn(24, 40, generator=gen) for _ in range(4)]
    p = torch.nn.Parameter(weight.clone())
    optimizer = LibraryNorMuon([dict(params=[p], use_muon=True)], lr=0.02, weight_decay=0.1, foreach=False)
    for g in grads:
        p.grad = g.clone()
        optimizer.step()
    assert torch.allclose(ours(weight, grads, lr=0.02, wd=0.1), p.detach(), atol=1e-5)


@pytest.mark.slow
def test_normuon_owner_per_matrix_under_tp2_equals_one_process_bit_for_bit(tmp_path):
    code, text = launch(tmp_path / "normuon.log", DISTRIBUTED / "normuon_worker.py", nproc=2)
    assert code == 0 and text.count(" ok True") == 2, text[-3000:]


def test_parameter_split():
    """NorMuon: attention, MLP and fusion matrices; Adam: embeddings, norms, the headwise gate, 1-D,
    --adam-params globs."""
    model = build()
    normuon = {n for n, p in model.named_parameters() if uses_normuon(n, p)}
    assert {n.split(".", 3)[-1] for n in normuon if n.startswith("decoder.layers.0.")} == {
        "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
    assert {n for n in normuon if not n.startswith("decoder.")} == {"feedback_fusion.linear_state.weight", "feedback_fusion.linear_gate.weight"}
    assert len(normuon) == 4 * 4 + 2
    assert not any(uses_normuon(n, p, ["*feedback_fusion*"]) for n, p in model.named_parameters() if "feedback_fusion" in n)


@pytest.mark.parametrize("flag, value, change", [("--adam-lr", "0.001", "--adam-lr 0.0005 → 0.001"),
                                                ("--weight-decay-schedule", "adamc", "--weight-decay-schedule")])
def test_resuming_with_another_adam_lr_or_weight_decay_schedule_needs_a_choice(flag, value, change):
    from fbt_megatron.commands import train
    from fbt_megatron.optimizers import schedule
    from fbt_megatron.recipe import RecipeError

    base = ["--recipe", "recipes/tiny_cpu.yaml", "--optimizer", "normuon", "--adam-lr", "5e-4", "--load", "RUN"]
    saved = {"iteration": 4, "lr_schedule": schedule.lr_schedule(train.parse_args(base))}
    with pytest.raises(RecipeError, match=f"another learning-rate schedule \\({change}"):
        schedule.choose_schedule(train.parse_args([*base, flag, value]), saved)


# ---------------------------------------------------------------- layouts, through the entry point
LAUNCHED = {  # name: (processes, worker flags)
    "tp2": (2, ["--blockwise", "--tensor-model-parallel-size", "2"]),
    "tp2_dp2": (4, ["--tensor-model-parallel-size", "2"]),
}
LAYOUTS = ["single", *LAUNCHED]


@pytest.fixture(scope="module")
def runs(small_corpus, tmp_path_factory):
    """The seed checkpoint and the one-process runs in this process (no launch to pay for), the
    other layouts launched."""
    from distributed.optimizer_worker import create_seed, run_layout

    root, corpus = tmp_path_factory.mktemp("optimizers"), Path(small_corpus.train_prefix).parent
    threads = torch.get_num_threads()
    try:
        create_seed(corpus, root / "seed", root / "model.json")
        for name, (nproc, flags) in LAUNCHED.items():
            args = ["--corpus", corpus, "--seed-checkpoint", root / "seed", "--out", root / name]
            code, text = launch(root / f"{name}.log", DISTRIBUTED / "optimizer_worker.py", *args, *flags, nproc=nproc)
            assert code == 0, text[-4000:]
        run_layout(corpus, root / "seed", root / "single", resume_from=root / "tp2" / "part")
    finally:
        torch.set_num_threads(threads)  # the entry point sets --threads 1
    return root


def losses(folder):
    return [r["loss"] for r in read_metrics(folder)]


def weights(runs, folder):
    model_args = json.loads((runs / "model.json").read_text())
    return equivalence.tensors(folder / "iter_0000007", model_args)


def worst(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(equivalence.relative(a[name], b[name]) for name in a)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_equals_one_process_and_resumes_bit_exactly(layout, runs):
    full = losses(runs / layout / "full")
    assert len(full) == 7 and losses(runs / layout / "part") == full  # floats equal: bit-exact resume
    reference = losses(runs / "single" / "full")
    assert equivalence.relative(torch.tensor(reference), torch.tensor(full)) < TOLERANCE
    reference_weights = weights(runs, runs / "single" / "full")
    assert worst(reference_weights, weights(runs, runs / layout / "full")) < TOLERANCE
    assert worst(weights(runs, runs / "single" / "full"), weights(runs, runs / layout / "part")) < TOLERANCE


@pytest.mark.slow
def test_tp2_checkpoint_resumes_at_tp1(runs):
    """Saved at TP 2 (step 4), continued in one process: the remaining steps equal one process's."""
    reference, cross = losses(runs / "single" / "full"), losses(runs / "single" / "cross")
    assert len(cross) == 3 and equivalence.relative(torch.tensor(reference[4:]), torch.tensor(cross)) < TOLERANCE
    assert worst(weights(runs, runs / "single" / "full"), weights(runs, runs / "single" / "cross")) < TOLERANCE


@pytest.mark.slow
def test_blockwise_tp_differs_from_the_whole_matrix_update(runs):
    assert worst(weights(runs, runs / "single" / "full"), weights(runs, runs / "tp2" / "blockwise")) > 1e-3


@pytest.mark.slow
def test_optimizer_state_per_rank_drops_with_dp(runs):
    schedule = {name: json.loads((runs / name / "schedule.json").read_text()) for name in LAYOUTS}
    tp2, tp2_dp2 = schedule["tp2"]["state_bytes"], schedule["tp2_dp2"]["state_bytes"]  # ranks: TP fastest, then DP
    print(f"optimizer state bytes per rank: 1 process {schedule['single']['state_bytes']}, TP 2 {tp2}, TP 2 × DP 2 {tp2_dp2}")
    for tp_rank in range(2):
        owners = tp2_dp2[tp_rank::2]
        assert sum(owners) == tp2[tp_rank] and max(owners) < 0.7 * tp2[tp_rank]


@pytest.mark.slow
def test_lr_and_weight_decay_follow_wsd_and_adamc(runs):
    """Per iteration i (T = 7, warmup W = 1, decay D = round(0.5 T) = 4 from T − D = 3): lr = peak·i/W,
    then peak, then peak·(1 − (i − 3)/D); NorMuon's wd = 0.1 before the cooldown (i ≥ 4, the first
    lower lr), 0.1·lr/peak in it; Adam's wd = 0."""
    s = json.loads((runs / "single" / "schedule.json").read_text())
    assert s["peaks"] == [0.02, 0.005] and s["cooldown_start"] == 4
    for i, ((normuon_lr, normuon_wd), (adam_lr, adam_wd)) in enumerate(s["curve"]):
        factor = i if i <= 1 else 1.0 if i <= 3 else 1 - (i - 3) / 4
        assert normuon_lr == pytest.approx(0.02 * factor) and adam_lr == pytest.approx(0.005 * factor)
        assert normuon_wd == pytest.approx(0.1 * (factor if i >= 4 else 1.0)) and adam_wd == 0.0
