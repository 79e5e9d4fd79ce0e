"""The rehearsal: a recipe's model at its real width through every entry point a run uses, on this
machine, each stage timed and measured (``tools/rehearse.py``; docs/planning.md).

``vocabulary.py`` widens a corpus's sentencepiece tokenizer to the recipe's vocabulary,
``measure.py`` runs one stage as a child process (wall time, peak memory, its log), ``checks.py``
holds the comparisons (losses, safetensors, greedy tokens), ``hf_check.py`` and ``vllm_check.py`` are the
children that load an export with transformers and serve it with vLLM, ``stages.py`` runs the stages in order and ``report.py`` prints the
table and writes ``rehearsal.json``.
"""
