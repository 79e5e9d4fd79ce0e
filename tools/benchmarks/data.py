"""Corpus preparation (``tools/benchmark.py --data``): ``preprocess_data`` with W workers (``--threads``)
against the raw tokenizer run the way its workers run: a pool of W processes started for the call,
handed the same text in the same chunks, each tokenizing what it gets and nothing else (no JSON, no
ids sent back, nothing written), so that "per core" means the same on both sides; for a
sentencepiece model and an HF ``tokenizer.json``.
With ``--megatron-lm DIR`` also against Megatron-LM's own ``tools/preprocess_data.py`` at W workers
(its own timing, from its first document to its last, without start-up), whose ``.bin/.idx`` are
compared byte for byte. Then its peak memory at 1× and 10× the input (the standard library's text
repeated, as JSONL; ``--data-megabytes``)."""

from __future__ import annotations

import filecmp
import json
import multiprocessing
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from .measure import Ratio, Seconds, median_ratio, progress, settings, time_rounds
from .report import format_report as report

FLAG = "--data"
HELP = ("measure corpus preparation instead: preprocess_data against the raw tokenizers and Megatron-LM's "
        "preprocess_data, peak memory from 1× to 10× the input")
DEFAULTS = dict(preset="tiny", micro_batch_size=1, repeats=3, warmup=1)
MEGABYTES = 16  # text timed (and the small input of the memory ratio); --quick: 1/64
KINDS = ("sentencepiece", "huggingface")
MEGATRON_TYPES = {"sentencepiece": "SentencePieceTokenizer", "huggingface": "HuggingFaceTokenizer"}
RATIOS = [Ratio(f"preprocess_per_core_vs_raw_{k}", f"preprocess_data tokens/s per core / raw {k}", "throughput",
                f"raw {k}", f"preprocess {k}", (">=", 0.9)) for k in KINDS]
RATIOS += [Ratio(f"preprocess_cpu_vs_raw_{k}", f"preprocess_data tokens per CPU-second / raw {k}", "throughput",
                 f"raw {k} CPU", f"preprocess {k} CPU") for k in KINDS]
RATIOS += [Ratio(f"preprocess_vs_megatron_lm_{k}", f"preprocess_data tokens/s / Megatron-LM's, {k}", "throughput",
                 f"Megatron-LM {k}", f"preprocess {k}", (">=", 1.0)) for k in KINDS]
RATIOS.append(Ratio("preprocess_peak_memory_10x", "preprocess_data peak memory, 10× input / 1×", "memory",
                    "10x", "1x", ("<=", 1.2)))
PEAK = """
import subprocess, sys, time, psutil
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
proc, peak = psutil.Process(child.pid), 0
while child.poll() is None:
    try:
        peak = max(peak, sum(p.memory_full_info().pss for p in [proc, *proc.children(recursive=True)]))
    except psutil.Error:
        pass
    time.sleep(0.2)
print(peak if child.returncode == 0 else -1)
"""
PROCESSED = re.compile(r"Processed (\d+) documents \(([\d.e+-]+) docs/s")  # Megatron-LM's progress line

_raw_tokenizer = None  # a raw worker's tokenizer


def write_text(path: str, megabytes: float) -> list[str]:
    """The standard library's documents repeated as JSONL at `path`, about `megabytes`; the texts."""
    from fbt_megatron.data.corpus import source_documents

    docs, texts, size = [d.text for d in source_documents("stdlib")], [], 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 1e6:
            text = f"# copy {len(texts) // len(docs)}\n" + docs[len(texts) % len(docs)]
            f.write(json.dumps({"text": text}) + "\n")
            texts.append(text)
            size += len(text)
    return texts


def tokenizers_for(folder: str, texts: list[str]) -> dict:
    """A sentencepiece BPE and a byte-level HF BPE tokenizer.json, 8,192 pieces, trained on `texts`
    (the latter in a folder with the tokenizer_config.json that names its EOD for Megatron-LM)."""
    import tokenizers

    from fbt_megatron.data.tokenizer_training import train_sentencepiece

    sp = train_sentencepiece(texts[:200], os.path.join(folder, "sp.model"), 8192, show_progress=False)
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    hf.train_from_iterator(texts[:200], tokenizers.trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"]))
    os.makedirs(os.path.join(folder, "hf"))
    hf.save(os.path.join(folder, "hf", "tokenizer.json"))
    with open(os.path.join(folder, "hf", "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}, f)
    return {"sentencepiece": sp, "huggingface": os.path.join(folder, "hf", "tokenizer.json")}


def prepare(folder: str, source: str, megabytes: float) -> tuple[dict, dict]:
    """The JSONL at `source`, the two tokenizers trained on it and each one's token count (EOD
    included). Run in a process of its own: training starts the tokenizers library's thread pool,
    and processes forked from one that did were seen to tokenize slower (once, at 64 MB: raw HF 1,445
    against 1,234–1,278 ns per token)."""
    from fbt_megatron.data.tokenizer import load_tokenizer

    texts = write_text(source, megabytes)
    paths = tokenizers_for(folder, texts)
    tokenizers = {k: load_tokenizer(p) for k, p in paths.items()}
    return paths, {k: sum(len(t.tokenize(text)) + 1 for text in texts) for k, t in tokenizers.items()}


def _start_raw(path: str) -> None:
    from fbt_megatron.data.tokenizer import load_tokenizer

    global _raw_tokenizer
    _raw_tokenizer = load_tokenizer(path)


def _tokenize_chunk(texts: list[str]) -> float:
    """Tokenize a chunk; the CPU seconds it took."""
    start = time.process_time()
    for text in texts:
        _raw_tokenizer.tokenize(text)
    return time.process_time() - start


def raw_tokenize(path: str, texts: list[str], workers: int) -> float:
    """The raw tokenizer over `texts` in a pool of `workers` processes started for the call, handed
    the chunks ``preprocess_data``'s workers get; the CPU seconds spent tokenizing."""
    from fbt_megatron.data.preprocess import chunks

    with multiprocessing.get_context("fork").Pool(workers, _start_raw, (path,)) as pool:
        work = (chunk for _, chunk in chunks(enumerate(texts)))
        return sum(pool.imap(_tokenize_chunk, work))


def _cpu(usage) -> float:
    return usage.ru_utime + usage.ru_stime


def megatron_lm(args, folder: str, source: str, kind: str, path: str, documents: int) -> Seconds:
    """Megatron-LM's tools/preprocess_data.py on `source`: seconds from its first document to its
    last, as its own progress line gives them (one line, after the last document)."""
    model = os.path.dirname(path) if kind == "huggingface" else path
    command = [args.megatron_lm_python or sys.executable, os.path.join(args.megatron_lm, "tools", "preprocess_data.py"),
               "--input", source, "--output-prefix", os.path.join(folder, f"megatron-{kind}"),
               "--tokenizer-type", MEGATRON_TYPES[kind], "--tokenizer-model", model, "--workers", str(args.threads),
               "--append-eod", "--log-interval", str(documents)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    found = PROCESSED.findall(done.stderr)
    if done.returncode or not found:
        raise RuntimeError(f"Megatron-LM's preprocess_data failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
    count, rate = found[-1]
    return Seconds(int(count) / float(rate))


def measure(args) -> dict:
    """Raw tokenizer (W processes), preprocess_data (W workers) and, given, Megatron-LM's
    preprocess_data (W workers) on the same text, in interleaved rounds; the coordinating process's
    CPU time; the peak memory of preprocess_data at 1× and 10× the text, in children."""
    from fbt_megatron.common import processes
    from fbt_megatron.data.preprocess import preprocess

    processes.install()  # the raw tokenizer's processes die with this one
    load_before = os.getloadavg()[0]
    megabytes = args.data_megabytes or (MEGABYTES / 64 if args.quick else MEGABYTES)
    workers = args.threads
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "docs.jsonl")
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            paths, tokens = pool.apply(prepare, (folder, source, megabytes))
        with open(source, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]
        cpu = {name: [] for k in KINDS for name in (f"raw {k} CPU", f"preprocess {k} CPU", f"coordinator {k}")}

        def raw(kind):
            return lambda: cpu[f"raw {kind} CPU"].append(raw_tokenize(paths[kind], texts, workers))

        def pre(kind):  # CPU seconds: the coordinating process (reads, parses, writes) and its reaped workers
            def run():
                me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
                preprocess([source], paths[kind], os.path.join(folder, f"ours-{kind}"), workers=workers, show_progress=False)
                coordinator = _cpu(resource.getrusage(resource.RUSAGE_SELF)) - _cpu(me)
                cpu[f"coordinator {kind}"].append(coordinator)
                cpu[f"preprocess {kind} CPU"].append(coordinator + _cpu(resource.getrusage(resource.RUSAGE_CHILDREN)) - _cpu(children))
            return run

        steps = {**{f"raw {k}": raw(k) for k in KINDS}, **{f"preprocess {k}": pre(k) for k in KINDS}}
        if args.megatron_lm:
            steps.update({f"Megatron-LM {k}": (lambda k=k: megatron_lm(args, folder, source, k, paths[k], len(texts)))
                          for k in KINDS})
        with progress((args.warmup + args.repeats) * len(steps), "data benchmark", "run") as bar:
            times = time_rounds(steps, args.warmup + args.repeats, bar)
        times = {name: t[args.warmup:] for name, t in times.items()}
        identical = {k: all(filecmp.cmp(os.path.join(folder, f"ours-{k}{ext}"),
                                        os.path.join(folder, f"megatron-{k}_text_document{ext}"), shallow=False)
                            for ext in (".bin", ".idx")) for k in KINDS} if args.megatron_lm else {}
        peaks = peak_memory(folder, source, paths["sentencepiece"], workers)
    cpu = {name: c[args.warmup:] for name, c in cpu.items()}
    values = [median_ratio(times[f"raw {k}"], times[f"preprocess {k}"]) for k in KINDS]
    values += [median_ratio(cpu[f"raw {k} CPU"], cpu[f"preprocess {k} CPU"]) for k in KINDS]
    values += [median_ratio(times[f"Megatron-LM {k}"], times[f"preprocess {k}"]) if args.megatron_lm else None for k in KINDS]
    values.append(peaks["10x"] / peaks["1x"])
    ratios = {r.key: r.result(v) for r, v in zip(RATIOS, values) if v is not None}
    rates = {name: tokens[name.split()[-1]] / statistics.median(t) for name, t in times.items()}
    return {"settings": settings(args, load_before), "ratios": ratios, "megabytes": megabytes, "workers": workers,
            "tokens": tokens, "tokens_per_second": rates, "peak_pss_bytes": peaks,
            "cpu_ns_per_token": {name: 1e9 * statistics.median(c) / tokens[name.split()[1]] for name, c in cpu.items()},
            "megatron_lm": args.megatron_lm, "megatron_lm_identical": identical}


def peak_memory(folder: str, source: str, tokenizer: str, workers: int) -> dict:
    """Peak PSS (all processes) of tools/preprocess_data.py on `source` (1x) and on it ten times (10x)."""
    big = os.path.join(folder, "big.jsonl")
    with open(big, "w") as out, open(source) as small:
        for _ in range(10):
            small.seek(0)
            out.write(small.read())
    peaks = {}
    for name, path in (("1x", source), ("10x", big)):
        command = [sys.executable, "-c", PEAK, sys.executable, os.path.join(os.path.dirname(__file__), "..", "preprocess_data.py"),
                   "--input", path, "--tokenizer", tokenizer, "--output-prefix", os.path.join(folder, name),
                   "--workers", str(workers)]
        peaks[name] = int(subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()[-1])
    return peaks


def format_report(results: dict) -> str:
    w, peaks = results["workers"], results["peak_pss_bytes"]
    rows = [[name, f"{rate:,.0f}", f"{rate / w:,.0f}"] for name, rate in results["tokens_per_second"].items()]
    ns = results["cpu_ns_per_token"]
    notes = [f"raw: {w} process{'es' * (w > 1)} started for the call, handed preprocess_data's chunks, tokenizing "
             "only; Megatron-LM: its own "
             f"timing (first to last document, without start-up); per core: tokens/s / {w}",
             "CPU per token: " + "; ".join(f"{k}: raw {ns[f'raw {k} CPU']:,.0f} ns, preprocess_data {ns[f'preprocess {k} CPU']:,.0f} "
                                          f"ns of which its coordinating process {ns[f'coordinator {k}']:,.0f} ns" for k in KINDS)]
    notes += [f"peak memory (PSS, all processes) of preprocess_data: {peaks['1x'] / 1e6:,.0f} MB at "
             f"{results['megabytes']:g} MB of JSONL, {peaks['10x'] / 1e6:,.0f} MB at {10 * results['megabytes']:g} MB"]
    if results["megatron_lm"]:
        notes.append(f"Megatron-LM ({results['megatron_lm']}): .bin/.idx byte-identical to preprocess_data's: "
                     + ", ".join(f"{k} {'yes' if same else 'NO'}" for k, same in results["megatron_lm_identical"].items()))
    else:
        notes.append("Megatron-LM's preprocess_data: not run (give --megatron-lm DIR, a Megatron-LM checkout)")
    return report(results, f"corpus preparation: {results['megabytes']:g} MB of JSONL, {w} worker{'s' * (w > 1)}",
                  [("variant", 26), ("tokens/s", 12), ("per core", 12)], rows, notes)
