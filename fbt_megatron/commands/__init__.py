"""The commands: the top floor, where each command line is parsed and handed to the rooms below.

``python -m fbt_megatron.NAME`` runs ``fbt_megatron/NAME.py``, a shim of three lines that calls this
package's ``NAME.main`` (the command line stays as it always was):

train        training from a recipe, alone or under torchrun/srun (``fbt-train``)
torchrun     torchrun for training runs, ending as one process does
plan         the plan of a run: parameters, layout, memory, FLOPs, wall time
slurm        Slurm jobs: submit (a chain of stages), serve, evaluate, prepare, goodput
generate     text from a trained run, in any decode mode
convert      checkpoints to and from Hugging Face format (``fbt-convert``)
diagnostics  the paper's diagnostics: fixed point, prefill, probes, generation
studies      a study's grid of training runs (``fbt_megatron.experiments``), its tables and plots

Nothing below imports a command; importing this package imports none of them.
"""
