"""Corpus preparation (``tools/benchmark.py --data``): ``preprocess_data``'s tokens/s per core against
the raw tokenizer on the same text, for a sentencepiece model and an HF ``tokenizer.json``, and its
peak memory at 10× the input (the standard library's text repeated, as JSONL)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from .measure import Ratio, median_ratio, progress, settings, time_rounds
from .report import format_report as report

FLAG = "--data"
HELP = "measure corpus preparation instead: preprocess_data against the raw tokenizer, peak memory from 1× to 10× the input"
DEFAULTS = dict(preset="tiny", micro_batch_size=1, repeats=3, warmup=1)
MEGABYTES = 4  # text timed (and the small input of the memory ratio); --quick: 1/16
KINDS = ("sentencepiece", "huggingface")
RATIOS = [Ratio(f"preprocess_per_core_vs_raw_{k}", f"preprocess_data tokens/s per core / raw {k}", "throughput",
                f"raw {k}", f"preprocess {k}", (">=", 0.9)) for k in KINDS]
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
    """A sentencepiece BPE and a byte-level HF BPE tokenizer.json, 8,192 pieces, trained on `texts`."""
    import tokenizers

    from fbt_megatron.data.tokenizer_training import train_sentencepiece

    sp = train_sentencepiece(texts[:200], os.path.join(folder, "sp.model"), 8192, show_progress=False)
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    hf.train_from_iterator(texts[:200], tokenizers.trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"]))
    hf.save(os.path.join(folder, "tokenizer.json"))
    return {"sentencepiece": sp, "huggingface": os.path.join(folder, "tokenizer.json")}


def measure(args) -> dict:
    """Raw tokenizer and preprocess_data (--threads workers) times on the same text, in
    interleaved rounds; the peak memory of preprocess_data at 1× and 10× the text, in children."""
    from fbt_megatron.data.preprocess import preprocess
    from fbt_megatron.data.tokenizer import load_tokenizer

    load_before = os.getloadavg()[0]
    megabytes = MEGABYTES / 16 if args.quick else MEGABYTES
    workers = args.threads
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "docs.jsonl")
        texts = write_text(source, megabytes)
        paths = tokenizers_for(folder, texts)
        tokens = {k: sum(len(load_tokenizer(p).tokenize(t)) + 1 for t in texts) for k, p in paths.items()}

        def raw(path):
            tok = load_tokenizer(path)
            return lambda: [tok.tokenize(t) for t in texts]

        def pre(path):
            return lambda: preprocess([source], path, os.path.join(folder, "out"), workers=workers, show_progress=False)

        steps = {**{f"raw {k}": raw(p) for k, p in paths.items()}, **{f"preprocess {k}": pre(p) for k, p in paths.items()}}
        with progress((args.warmup + args.repeats) * len(steps), "data benchmark", "run") as bar:
            times = time_rounds(steps, args.warmup + args.repeats, bar)
        times = {name: t[args.warmup:] for name, t in times.items()}
        # per core: the raw tokenizer on one core against preprocess_data on `workers` cores
        per_core = {k: median_ratio(times[f"raw {k}"], [t * workers for t in times[f"preprocess {k}"]]) for k in KINDS}
        big = os.path.join(folder, "big.jsonl")
        with open(big, "w") as out, open(source) as small:
            for _ in range(10):
                small.seek(0)
                out.write(small.read())
        peaks = {}
        for name, path in (("1x", source), ("10x", big)):
            command = [sys.executable, "-c", PEAK, sys.executable, os.path.join(os.path.dirname(__file__), "..", "preprocess_data.py"),
                       "--input", path, "--tokenizer", paths["sentencepiece"], "--output-prefix", os.path.join(folder, name),
                       "--workers", str(workers)]
            peaks[name] = int(subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()[-1])
    ratios = {r.key: r.result(v) for r, v in zip(RATIOS, [*per_core.values(), peaks["10x"] / peaks["1x"]])}
    rates = {name: tokens[name.split()[1]] / statistics.median(t) for name, t in times.items()}
    return {"settings": settings(args, load_before), "ratios": ratios, "megabytes": megabytes, "workers": workers,
            "tokens": tokens, "tokens_per_second": rates, "peak_pss_bytes": peaks}


def format_report(results: dict) -> str:
    w = results["workers"]
    rows = [[name, f"{rate:,.0f}", f"{rate / (w if name.startswith('preprocess') else 1):,.0f}"]
            for name, rate in results["tokens_per_second"].items()]
    peaks = results["peak_pss_bytes"]
    return report(results, f"corpus preparation: {results['megabytes']:g} MB of JSONL, preprocess_data with {w} workers",
                  [("variant", 26), ("tokens/s", 12), ("per core", 12)], rows,
                  [f"peak memory (PSS, all processes) of preprocess_data: {peaks['1x'] / 1e6:,.0f} MB at 1×, "
                   f"{peaks['10x'] / 1e6:,.0f} MB at 10× the text"])
