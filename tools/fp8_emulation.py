"""FP8 numerics of k passes, emulated on a CPU: the answer the first FP8 run on a GPU should reproduce.

Two runs of the same recipe, seed and data through the training entry point, with the model's
linears as Transformer Engine's (the CPU double in ``tests/doubles``, megatron-core's own TE
wrappers, on the simulated device): BF16, and FP8 at the project's default recipe (current
scaling, ``tensorwise``: every GEMM's input, weight and output gradient quantized with its own
per-tensor scale, E4M3 forward and E5M2 for gradients — ``fp8: hybrid``), every step k passes.
Quantization is emulated by casting to torch's float8 dtypes (saturated, round to nearest even):
the GEMMs multiply exactly the values an FP8 GEMM multiplies; their FP32 accumulation order is
not the tensor cores'.

It prints, and writes to ``<output>/results.md`` and ``results.png``, the training-loss gap FP8 − BF16
(mean over the last tenth of the steps), the validation losses per decoding mode at the end, and
the fixed point's ‖Δs‖ (the RMS change of the top state from pass j−1 to pass j) at the end.

    python tools/fp8_emulation.py                       # tiny_cpu, k = 3, 400 steps (~40 min on 2 cores)
    python tools/fp8_emulation.py --train-iters 40 --output runs/fp8-quick
    python tools/fp8_emulation.py --seed 1235 --output runs/fp8-emulation-1235   # another seed: the noise
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics  # noqa: E402

RUNS = {"bf16": [], "fp8": ["--fp8", "hybrid"]}  # FP8 at the default recipe (model.te_calls)


def command(args, extra: list, save: Path) -> list:
    return [sys.executable, "-m", "fbt_megatron.train", "--recipe", args.recipe, "--threads", "1", "--bf16", "true",
            "--train-iters", str(args.train_iters), "--log-interval", "1", "--eval-interval", str(args.train_iters),
            "--tensorboard", "false", "--pass-phases", f"[{{start: 0.0, passes: {args.passes}}}]", "--seed", str(args.seed), *extra,
            "--save", str(save)]


def train(args) -> dict:
    """Both runs side by side (one thread each), a progress bar per run; their metrics records."""
    env = {**os.environ, "FBT_SIMULATED_DEVICE": "1", "PYTHONPATH": str(ROOT / "tests" / "doubles")}
    procs, bars = {}, {}
    for position, (name, extra) in enumerate(RUNS.items()):
        save = args.output / name
        if len(read_metrics(save)) >= args.train_iters:
            continue  # finished earlier
        log = open(args.output / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(command(args, extra, save), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), save)
        bars[name] = tqdm(total=args.train_iters, desc=name, position=position, unit="step")
    while procs:
        for name, (proc, save) in list(procs.items()):
            bars[name].update(len(read_metrics(save)) - bars[name].n)
            if proc.poll() is not None:
                bars[name].close()
                del procs[name]
                if proc.returncode:
                    sys.exit(f"error: the {name} run failed (exit {proc.returncode}); see {args.output / name}.log")
        time.sleep(2)
    return {name: read_metrics(args.output / name) for name in RUNS}


def summary(records: dict) -> dict:
    """The loss gap over the last tenth, validation per mode and ‖Δs‖ at the end, per run."""
    tail = max(1, len(records["bf16"]) // 10)
    out = {}
    for name, recs in records.items():
        last = recs[-1]
        out[name] = {
            "loss": mean(r["loss"] for r in recs[-tail:]),
            "valid": {k: v for k, v in last.items() if k.startswith("valid_loss")},
            "deltas": [mean(r["state_deltas"][j] for r in recs[-tail:]) for j in range(len(last["state_deltas"]))],
        }
    out["gap"] = out["fp8"]["loss"] - out["bf16"]["loss"]
    return out


def report(args, records: dict, s: dict) -> str:
    steps = len(records["bf16"])
    lines = [f"# FP8 (tensorwise, emulated) against BF16: {args.recipe}, k = {args.passes}, {steps} steps, seed {args.seed}",
             "", "| | BF16 | FP8 | FP8 − BF16 |", "|---|---|---|---|",
             f"| training loss, mean of the last {max(1, steps // 10)} steps | {s['bf16']['loss']:.4f} | "
             f"{s['fp8']['loss']:.4f} | {s['gap']:+.4f} ({s['gap'] / s['bf16']['loss']:+.2%}) |"]
    for key in s["bf16"]["valid"]:
        a, b = s["bf16"]["valid"][key], s["fp8"]["valid"][key]
        lines.append(f"| {key.replace('_', ' ')} at the end | {a:.4f} | {b:.4f} | {b - a:+.4f} |")
    for j, (a, b) in enumerate(zip(s["bf16"]["deltas"], s["fp8"]["deltas"]), start=2):
        lines.append(f"| ‖Δs‖ pass {j - 1}→{j}, last steps | {a:.4f} | {b:.4f} | {b - a:+.4f} |")
    return "\n".join(lines) + "\n"


def plot(records: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss, delta) = plt.subplots(1, 2, figsize=(11, 4))
    for name, recs in records.items():
        loss.plot([r["step"] for r in recs], [r["loss"] for r in recs], label=name, linewidth=1)
        for j in range(len(recs[-1]["state_deltas"])):
            delta.plot([r["step"] for r in recs], [r["state_deltas"][j] for r in recs], label=f"{name} pass {j + 1}→{j + 2}",
                       linewidth=1)
    loss.set(xlabel="step", ylabel="training loss", title="loss"), loss.legend()
    delta.set(xlabel="step", ylabel="‖Δs‖", title="fixed point: ‖s(j) − s(j−1)‖"), delta.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/tiny_cpu.yaml")
    parser.add_argument("--train-iters", type=int, default=400)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "fp8-emulation")
    args = parser.parse_args(argv)
    if args.train_iters < 1 or args.passes < 2:
        parser.error("--train-iters must be >= 1 and --passes >= 2 (the fixed point needs two passes)")
    args.output.mkdir(parents=True, exist_ok=True)
    records = train(args)
    text = report(args, records, summary(records))
    (args.output / "results.md").write_text(text)
    plot(records, args.output / "results.png")
    print(text + f"\nwritten: {args.output / 'results.md'}, {args.output / 'results.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
