"""The rehearsal's stages, in order, each a run of a real entry point (``measure.run_stage``).

1. ``train``: training from scratch, step 1 at k = 1, step 2 at k = 3 (``--recompute-passes true``),
   the recipe's optimizer, a checkpoint after every step (``--async-save`` where the budget holds it, ``fit``);
2. ``resume``: from the step-1 checkpoint, step 2 again: its losses must equal ``train``'s bit for bit,
   and its one checkpoint, saved async (the last save of a run: no step runs beside its copies), must
   equal ``train``'s step-2 checkpoint file for file;
3. ``reshard``: the same from the step-1 checkpoint at TP ``reshard_tp`` (torchrun, one process per
   rank, saves as ``train``'s: its async last save measured 9.99 GiB per rank at fbt-1b, 1.03× the
   planner's blocking estimate): step 2's losses equal ``train``'s to float32 summation order;
4. ``export``: ``convert to-hf`` in bfloat16, sharded safetensors with an index;
5. ``import``: ``convert from-hf`` of the export; ``re-export``: to-hf again, equal tensor for tensor;
6. ``hf``: the export loaded offline by transformers (``hf_check``), greedy tokens in each mode;
7. ``generate``: megatron's ``generate`` of the imported run in each mode: the same tokens as ``hf``;
8. ``vllm``: the export served by vLLM's CPU engine, when ``.venv-serve`` has it; without it the stage
   is a SKIP and the report is not ok (``--no-vllm``: not asked, no SKIP).

Every stage runs with ``measure.EXACT_ENV`` (on a GPU: no TF32, deterministic attention), since
``resume`` compares bits and ``generate`` greedy tokens. The report is ``report.Report`` (the
``CheckReport`` of ``tools/gpu_check.py`` too): ok only when every check ran and passed.

The planner's estimate (``fbt_megatron.plan``, with a CPU process's terms) of the training ranks'
memory is set against the largest process RSS measured, and decides what fits the memory budget
(``fit``; the budget holds a stage's processes together, the reshard stage's ranks too): the recipe's
layers with async saves, else with blocking saves in ``train`` (the async writer's copies outlive the
save into step 2 on CPU; the resumed run's last save stays async), else the most layers that fit at the
same width; ``--num-layers`` is kept as asked. The vocabulary is the preset's, the corpus's sentencepiece widened to it
(``vocabulary.py``); the data are the embedded corpus.
"""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import torch

from fbt_megatron.common.cli import plural
from fbt_megatron.launch.rehearsal import checks
from fbt_megatron.launch.rehearsal.measure import EXACT_ENV, GiB, Measured, run_stage
from fbt_megatron.launch.rehearsal.report import Report

REPO = Path(__file__).resolve().parents[3]
PASSES = "[{start: 0.0, passes: 1}, {start: 0.5, passes: 3}]"  # 2 steps: k = 1, then k = 3
MODES = ("standard", "soft", "fused:2")
PROMPT = "def main(argv=None):\n    "
CORPUS_VOCAB = 2048
FIT_MARGIN = 1.1  # the planner's CPU estimate has been within 7% of the measured RSS (docs/planning.md)
RESHARD_TOLERANCE = {False: 1e-5, True: 2e-2}  # half precision? TP 2's reductions round in another order: fp32, bf16


@dataclass
class Options:
    recipe: str
    output: Path
    num_layers: Optional[int] = None  # None: the recipe's, or the most that fit memory_budget_gib
    memory_budget_gib: Optional[float] = None  # a stage's processes together on CPU; None: 90% of the memory available at the start
    seq_length: int = 256
    vocab_size: Optional[int] = None  # None: the preset's; the tokenizer is widened to it
    data_path: str = "data/stdlib-sp2048"
    nproc_per_node: int = 1  # processes of the training stages (a GPU node's layout: with train_flags)
    reshard_tp: int = 2
    max_new_tokens: int = 8
    max_shard_size: str = "1GB"
    train_flags: List[str] = field(default_factory=list)  # further training flags (a job's layout, --bf16 true)
    threads: int = 0  # torch threads per process (0: torch's default)
    serve_python: Optional[str] = None  # a Python with vLLM (default: .venv-serve's once make serve-setup finished)
    vllm: bool = True  # False: the vllm stage is skipped
    echo: bool = False


class Rehearsal:
    def __init__(self, options: Options):
        self.o, self.out = options, options.output.resolve()
        self.report = Report(self.out)
        self.python = sys.executable
        self.gpu = torch.cuda.is_available()  # a GPU node's pre-flight

    # ------------------------------------------------------------ helpers
    def stage(self, name: str, command: List, output: Optional[Path] = None, **env) -> Measured:
        m = run_stage(name, command, self.out / "logs" / f"{name}.log", REPO, env={**EXACT_ENV, **env}, echo=self.o.echo)
        self.report.stage(m, output)
        if not m.ok():
            raise StageFailed(f"stage {name} failed (exit {m.code}); end of {m.log}:\n{m.tail()}")
        return m

    def json_of(self, m: Measured) -> dict:
        """The JSON line a child printed last (libraries may print after it)."""
        found = [text for _, text in m.lines if text.startswith("{")]
        if not found:
            raise StageFailed(f"stage {m.name} printed no JSON line; end of {m.log}:\n{m.tail()}")
        return json.loads(found[-1])

    def train_command(self, folder: Path, nproc: int, *extra) -> List:
        launcher = [self.python, "-m", "fbt_megatron.train"] if nproc == 1 else \
            [self.python, "-m", "fbt_megatron.torchrun", "--standalone", "--nproc-per-node", nproc, "-m", "fbt_megatron.train"]
        return [*launcher, *self.train_flags(), "--save", folder, *extra]

    def train_flags(self) -> List:
        o = self.o
        flags = ["--recipe", o.recipe, "--seq-length", o.seq_length, "--micro-batch-size", 1, "--global-batch-size", 1,
                 "--train-iters", 2, "--eval-iters", 0, "--log-interval", 1, "--tensorboard", "false",
                 "--tensor-model-parallel-size", 1, "--pipeline-model-parallel-size", 1, "--sequence-parallel", "false",
                 "--bf16", "false", "--data-path", o.data_path, "--corpus", "null", "--train-data-path", "null",
                 "--tokenizer-model", self.tokenizer, "--vocab-size", self.vocab, "--pass-phases", PASSES,
                 "--recompute-passes", "true", "--save-interval", 1, "--async-save", str(self.async_save).lower(),
                 "--threads", o.threads, "--num-layers", self.layers]
        return [*flags, *o.train_flags]

    # ------------------------------------------------------------ the stages
    def run(self) -> Report:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(exist_ok=True)
        try:
            self.prepare()
            self.fit()
            self.plan()
            self.training()
            self.hugging_face()
            self.vllm()
        except StageFailed as e:
            self.report.failed(str(e), self.not_reached())
        except Exception as e:  # a check that could not read what a stage left: the table still prints
            (self.out / "logs" / "rehearsal-error.log").write_text(traceback.format_exc())
            self.report.failed(f"{type(e).__name__}: {e} (traceback: logs/rehearsal-error.log)", self.not_reached())
        return self.report.finish()

    def not_reached(self) -> List[str]:
        """The stages a failure left unrun (vLLM's only when it was asked for)."""
        generate = [f"generate-{m.replace(':', '')}" for m in MODES]
        planned = ["train", "resume", "reshard", "export", "import", "re-export", "hf", *generate] + (["vllm"] if self.o.vllm else [])
        ran = {s["stage"] for s in self.report.stages}
        return [name for name in planned if name not in ran]

    def prepare(self) -> None:
        """The embedded corpus (prepared once) and its tokenizer widened to the model's vocabulary."""
        from fbt_megatron.data.corpus import load_corpus
        from fbt_megatron.launch.rehearsal.vocabulary import widen
        from fbt_megatron.model.config import make_config

        if not (REPO / self.o.data_path / "corpus.json").is_file():
            self.stage("corpus", [self.python, "tools/prepare_corpus.py", "--source", "stdlib", "--output", self.o.data_path,
                                  "--vocab-size", CORPUS_VOCAB])
        preset = self.recipe_preset()
        self.vocab = self.o.vocab_size or make_config(preset).vocab_size
        source = load_corpus(str(REPO / self.o.data_path)).tokenizer_path
        self.tokenizer = str(self.out / f"tokenizer-{self.vocab}.model")
        self.report.time("tokenizer", lambda: widen(source, self.tokenizer, self.vocab),
                         note=f"{Path(source).name} widened to {self.vocab:,} pieces")

    def recipe_preset(self) -> str:
        from fbt_megatron.recipe import flags

        return flags.parse(["--recipe", self.o.recipe], prog="rehearse", description="").model.preset

    def make_plan(self, world: int, tp: Optional[int] = None):
        """The planner's plan of the training flags as they stand (``tp``: the reshard stage's, planned with a
        blocking save: its one save follows its one step, so no step runs beside an async save's copies)."""
        from fbt_megatron.launch.plan.planner import make_plan
        from fbt_megatron.recipe import flags

        reshard = ["--tensor-model-parallel-size", str(tp), "--async-save", "false"] if tp else []
        argv = [str(x) for x in self.train_flags()] + reshard
        return make_plan(flags.parse(argv, prog="rehearse", description=""), world, transformer_engine=False)

    def fit(self) -> None:
        """The layers and the saves the memory budget holds (module docstring), said in one figure."""
        import psutil

        from fbt_megatron.model.config import make_config

        full = make_config(self.recipe_preset()).num_layers
        self.layers, self.async_save = self.o.num_layers or full, True
        if self.gpu:  # a GPU node's pre-flight: its memory is the GPU's, planned by train --dry-run
            return
        budget = self.o.memory_budget_gib or round(0.9 * psutil.virtual_memory().available / GiB, 1)
        tried = []
        for layers, async_save in [(self.layers, True), *[(n, False) for n in range(self.layers, 0, -1)]]:
            self.layers, self.async_save = layers, async_save
            need = max(self.stage_memory(world, tp) for world, tp in self.training_layouts())
            tried.append(f"{layers} layer{'s' if layers > 1 else ''} with {'async' if async_save else 'blocking'} saves {need / GiB:.2f} GiB")
            if need * FIT_MARGIN <= budget * GiB or self.o.num_layers and not async_save:
                break
        fits = need * FIT_MARGIN <= budget * GiB
        saves = "async saves" if self.async_save else "train's and reshard's saves blocking, the resumed run's (its last) async"
        self.report.figure("layers and saves rehearsed", self.layers, f"of {full} layers",
                           f"{saves}; the planner's largest stage (its processes together): "
                           + " > ".join(tried if len(tried) < 4 else [*tried[:2], "…", tried[-1]]) + f" (× {FIT_MARGIN} margin vs the budget "
                           + f"{budget} GiB{'' if self.o.memory_budget_gib else ', 90% of the memory available'}"
                           + ("" if fits else ": does not fit; run anyway") + ")")

    def half_precision(self) -> bool:
        """Whether the training flags train in bf16 or fp16 (the reshard stage's tolerance)."""
        from fbt_megatron.recipe import flags

        optimizer = flags.parse([str(x) for x in self.train_flags()], prog="rehearse", description="").optimizer
        return optimizer.bf16 or optimizer.fp16

    def training_layouts(self) -> List[tuple]:
        """(processes, TP or None: the flags') of the training stages: train and resume, reshard."""
        return [(self.o.nproc_per_node, None), (self.o.reshard_tp, self.o.reshard_tp)]

    def stage_memory(self, world: int, tp: Optional[int]) -> int:
        """The planner's bytes for a training stage's processes together (CPU terms: ``fbt_megatron.plan``)."""
        plan = self.make_plan(world, tp)
        return world * plan.memory[plan.chosen].total

    def plan(self) -> None:
        """The planner's memory per training rank, for the train stage's and the reshard stage's layouts."""
        from fbt_megatron.launch.plan.planner import format_plan

        self.planned = {}
        texts = []
        for stage, (world, tp) in zip(("train", "reshard"), self.training_layouts()):
            plan = self.planned[stage] = self.make_plan(world, tp)
            texts.append(f"# {stage}: {world} process(es)\n{format_plan(plan)}\n")
        (self.out / "plan.txt").write_text("\n".join(texts))
        self.report.planner(self.planned["train"])

    def training(self) -> None:
        o = self.o
        run, resumed, resharded = self.out / "run", self.out / "resumed", self.out / "tp2"
        train = self.stage("train", self.train_command(run, o.nproc_per_node), run)
        steps = checks.metrics(run)
        self.report.steps(train, steps, self.planned["train"], self.gpu)
        self.report.checkpoint(run / "iter_0000001", train)
        # the resumed run's one save is its last: async whatever fit chose (no step runs beside its copies)
        resume = self.stage("resume", self.train_command(resumed, o.nproc_per_node, "--load", run, "--ckpt-step", 1,
                                                         "--async-save", "true"), resumed)
        self.report.check_losses("resume from step 1 = uninterrupted, step 2 (k=3)", steps[2], checks.metrics(resumed)[2],
                                 tolerance=0.0)
        self.report.load_time(resume)
        self.report.saves("resume", resume)
        self.report.check("resume's step-2 checkpoint (async save) = train's, file for file",
                          *checks.same_checkpoint(resumed / "iter_0000002", run / "iter_0000002"), "equal bytes")
        reshard = self.stage("reshard", self.train_command(resharded, o.reshard_tp, "--load", run, "--ckpt-step", 1,
                                                           "--tensor-model-parallel-size", o.reshard_tp), resharded)
        ranks = plural(o.reshard_tp, "process", "processes")
        self.report.check_losses(f"resharded to TP {o.reshard_tp} ({ranks}), step 2 (k=3)", steps[2],
                                 checks.metrics(resharded)[2], tolerance=RESHARD_TOLERANCE[self.half_precision()])
        self.report.memory("reshard", reshard, self.planned["reshard"], self.gpu)
        self.run_folder = run

    def hugging_face(self) -> None:
        o = self.o
        hf, imported, again = self.out / "hf", self.out / "from_hf", self.out / "hf_again"
        convert = [self.python, "-m", "fbt_megatron.convert"]
        self.stage("export", [*convert, "to-hf", "--load", self.run_folder, "--output", hf, "--dtype", "bfloat16",
                                       "--max-shard-size", o.max_shard_size, "--tokenizer-model", self.tokenizer], hf)
        self.report.export(hf, o.max_shard_size)
        self.stage("import", [*convert, "from-hf", "--input", hf, "--save", imported], imported)
        self.stage("re-export", [*convert, "to-hf", "--load", imported, "--output", again, "--dtype", "bfloat16",
                                 "--max-shard-size", o.max_shard_size, "--tokenizer-model", self.tokenizer], again)
        self.report.check("from-hf then to-hf = the export, tensor for tensor", *checks.same_safetensors(hf, again), "bit for bit")

        from fbt_megatron.data.tokenizer import load_tokenizer

        prompt = load_tokenizer(self.tokenizer).tokenize(PROMPT)
        ids = self.prompt_ids = " ".join(map(str, prompt))
        modes = [a for m in MODES for a in ("--mode", m)]
        hf_run = self.stage("hf", [self.python, "-m", "fbt_megatron.launch.rehearsal.hf_check", "--export", hf, "--prompt", PROMPT,
                                   "--prompt-ids", ids, *modes, "--max-new-tokens", o.max_new_tokens],
                            HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(self.out / "hf_home"))
        got = self.json_of(hf_run)
        self.report.check("exported tokenizer (AutoTokenizer) = sentencepiece, the prompt's ids",
                          f"{len(got['tokenizer_ids'])} ids {'equal' if got['tokenizer_ids'] == prompt else 'DIFFER'}",
                          got["tokenizer_ids"] == prompt, "equal")
        self.hf_tokens = got["tokens"]
        for mode in MODES:
            name, _, n = mode.partition(":")
            fused = ["--fused-passes", n] if n else []
            m = self.stage(f"generate-{name}{n}", [self.python, "-m", "fbt_megatron.generate", "--load", imported,
                                                   "--tokenizer-model", self.tokenizer, "--prompt-ids", ids, "--mode", name,
                                                   *fused, "--max-new-tokens", o.max_new_tokens, "--ignore-eod",
                                                   "--print-ids", *(["--threads", o.threads] if o.threads else [])])
            megatron = checks.generated_ids(m, len(prompt))
            label = f"fused({n})" if n else name
            self.report.check(f"greedy tokens, {label}: transformers = megatron generate",
                              checks.describe_tokens(self.hf_tokens[mode], megatron), self.hf_tokens[mode] == megatron, "equal")

    def vllm(self) -> None:
        if not self.o.vllm:
            self.report.skip_stage("vllm", "--no-vllm", asked=False)
            return
        python = Path(self.o.serve_python or REPO / ".venv-serve" / "bin" / "python")
        ready = self.o.serve_python or (REPO / ".venv-serve" / ".installed").is_file()  # not while it is being built
        if not python.is_file() or not ready:
            self.report.skip_stage("vllm", f"no vLLM environment: {python} is missing or unfinished (make serve-setup builds "
                                   ".venv-serve; --no-vllm leaves the stage out)")
            return
        modes = [a for m in MODES for a in ("--mode", m)]
        m = self.stage("vllm", [python, "-m", "fbt_megatron.launch.rehearsal.vllm_check", "--export", self.out / "hf",
                                "--prompt-ids", self.prompt_ids, *modes, "--max-new-tokens", self.o.max_new_tokens],
                       HF_HOME=str(self.out / "hf_home"))
        served = self.json_of(m)["tokens"]
        for mode in MODES:
            name, _, n = mode.partition(":")
            self.report.check(f"greedy tokens, {f'fused({n})' if n else name}: vLLM = transformers",
                              checks.describe_tokens(self.hf_tokens[mode], served[mode], "vLLM"),
                              served[mode] == self.hf_tokens[mode], "equal")


class StageFailed(RuntimeError):
    pass


def rehearse(options: Options) -> Report:
    """Run every stage (module docstring) into ``options.output``; the report is printed and written."""
    return Rehearsal(options).run()
