"""Experiments, apart from evaluation: studies, declared grids of training runs (recipes × data × seeds ×
threads) run through the training entry point, and their tables and plots from the runs' logs.
``python -m fbt_megatron.studies`` (``fbt_megatron.commands.studies``)."""
