"""When a run's periodic work falls (steps 1-based, the step just run): validation
(``--eval-interval``) and the logged steps (``--log-interval``, every validation, the last). The
loop, the step (a logged step measures more) and the log (``metrics``) read them here."""

from __future__ import annotations

from fbt_megatron.recipe import Recipe


def validation_due(recipe: Recipe, step: int) -> bool:
    """Whether validation runs after step ``step``: every ``--eval-interval`` steps and after the
    last, unless ``--eval-iters`` is 0; whatever ``--log-interval`` is."""
    t = recipe.training
    return bool(t.eval_iters) and (step % t.eval_interval == 0 or step == t.train_iters)


def logged(recipe: Recipe, step: int) -> bool:
    """Whether step ``step`` makes a record: every ``--log-interval``, every validation, the last."""
    return (step % recipe.logging.log_interval == 0 or step == recipe.training.train_iters
            or validation_due(recipe, step))
