"""The training loop's callbacks (``fbt_megatron.trainer.callbacks.base``): a recording callback
registered after the recipe's in two real one-process runs (tests/distributed/callbacks_worker.py)
sees every hook, in the protocol's order, and after the recipe's callbacks: at ``on_step_end`` the
log has written the step's record (``metrics.jsonl``), at ``on_save`` the heartbeat names the step
and the checkpoint just written, at ``on_stop`` / ``on_failure`` the heartbeat has its last beat.
A run that fails (too many NaN steps) reaches ``on_failure``, then ``close``, then raises."""

import json
from pathlib import Path

from helpers import launch

from fbt_megatron.trainer.callbacks.base import Callback, Callbacks

DISTRIBUTED = Path(__file__).parent / "distributed"


def test_callbacks_are_called_in_registration_order():
    calls = []

    class Named(Callback):
        def __init__(self, name):
            self.name = name

        def on_save(self, state, checkpoint):
            calls.append(("save", self.name))

        def close(self):
            calls.append(("close", self.name))
            if self.name == "a":
                raise OSError("a")

    callbacks = Callbacks([Named("a"), Named("b")])
    callbacks.save(None, None)
    try:
        callbacks.close()
    except OSError:
        pass
    else:
        raise AssertionError("a close that fails is raised")
    assert calls == [("save", "a"), ("save", "b"), ("close", "a"), ("close", "b")]  # b closed after a failed


def test_a_run_calls_every_hook_in_order(tmp_path, small_corpus):
    code, text = launch(tmp_path / "worker.log", DISTRIBUTED / "callbacks_worker.py", Path(small_corpus.train_prefix).parent,
                        tmp_path, nproc=1)
    assert code == 0, text[-3000:]
    checkpoint = {1: None, 2: "iter_0000002", 3: "iter_0000002", 4: "iter_0000004"}
    finished = [["start", 0]]
    for step in range(1, 5):
        logged = step if step % 2 == 0 else None  # --log-interval 2: the record, already in metrics.jsonl
        finished += [["step_start", step - 1], ["step_end", step, logged, logged or (step - 1 if step > 1 else None)],
                     ["save", step, checkpoint[step], [step, checkpoint[step]]]]
    finished += [["stop", 4, "finished", [4, "iter_0000004"]], ["close"]]
    assert json.loads((tmp_path / "finished.json").read_text()) == finished
    # --inject-nan grad@2-3 --max-bad-steps 1: steps 2 and 3 bad, the save point of step 3 raises
    failed = [["start", 0], ["step_start", 0], ["step_end", 1, None, None], ["save", 1, None, [1, None]],
              ["step_start", 1], ["step_end", 2, 2, 2], ["save", 2, None, [2, None]],
              ["step_start", 2], ["step_end", 3, None, 2], ["failure", 3, "BadStepsError", [3, None]], ["close"],
              ["raised", "BadStepsError"]]
    assert json.loads((tmp_path / "failed.json").read_text()) == failed
