"""Evaluation: lm-eval on Hugging Face exports of FBT models, offline, in FBT's decode modes; the
synthetic state-tracking tasks (``tasks``); the paper's diagnostics (``diagnostics``). (Studies, grids
of training runs with their tables and plots, are ``fbt_megatron.experiments``.)

* ``local_tasks``: two lm-eval tasks built from held-out standard-library text on this machine
  (perplexity, ``loglikelihood_rolling``; next line out of four, ``multiple_choice``);
* ``lm``: lm-eval's ``fbt`` model (a subclass of its ``hf`` model) scoring requests as a decode mode
  (standard, soft, fused(n)) would produce them, through the export's ``decode_logits``;
* ``harness``: one export evaluated in any mode in this process;
* ``table``: models × decode modes into one table (markdown + json); ``models``: run folders exported
  on demand into a cache, or exports; ``own_split``: a model's own corpus's held-out split;
* ``env``: the offline Hugging Face environment (set before transformers/datasets/lm_eval load);
* ``python -m fbt_megatron.evaluation table|tasks|lm-eval ...``: the command line (see ``__main__``).

Importing this package imports neither lm_eval nor transformers.
"""
