"""The training loop's callbacks (``fbt_megatron.trainer.callbacks.base``): a recording callback
registered after the recipe's in two real one-process runs (tests/distributed/callbacks_worker.py)
sees every hook, in the protocol's order, and after the recipe's callbacks: at ``on_step_end`` the
log has written the step's record (``metrics.jsonl``), at ``on_save`` the heartbeat names the step
and the checkpoint just written, at ``on_stop`` / ``on_failure`` the heartbeat has its last beat.
Between ``on_step_start`` and ``on_step_end``, ``pre_optim_step`` with the step's losses,
``vetoes_update`` with its finite gradient norm (none for a NaN step) and ``post_step``, whose fields
reach a logged step's record beside the memory the recipe's callbacks add. A run that fails (too many NaN
steps) reaches ``on_failure``, then ``close``, then raises. A callback's state is saved in every
checkpoint under its name and given back to it before ``on_start`` of the resumed run."""

import json
from pathlib import Path
from types import SimpleNamespace

from helpers import launch

from fbt_megatron.trainer.callbacks.base import Callback, Callbacks
from fbt_megatron.trainer.callbacks.spikes import Spikes
from fbt_megatron.trainer.checkpointing import TrainState, read_train_state

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
    callbacks.save_point(SimpleNamespace(callbacks={}), None)
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
    checkpoint = {1: None, 2: "iter_0000002", 3: "iter_0000002", 4: "iter_0000004", 5: "iter_0000004", 6: "iter_0000006"}
    report = True  # the step's report has this rank's losses (the last pipeline stage's)

    def steps(first, last):
        out = []
        for step in range(first, last + 1):
            logged = step if step % 2 == 0 else None  # --log-interval 2: the record, already in metrics.jsonl
            out += [["step_start", step - 1], ["pre_optim", step - 1, report], ["veto?", step - 1], ["post", step, bool(logged)],
                    ["step_end", step, logged and [logged, logged, True], logged or (step - 1 if step > 1 else None)],
                    ["save", step, checkpoint[step], [step, checkpoint[step]]]]
        return out

    finished = [["start", 0], *steps(1, 4), ["stop", 4, "finished", [4, "iter_0000004"]], ["close"]]
    assert json.loads((tmp_path / "finished.json").read_text()) == finished
    # resumed to step 6: the recorder's state (4 step ends) back from its own key in the checkpoint, before on_start
    resumed = [["loaded", {"ends": 4}], ["start", 4], *steps(5, 6), ["stop", 6, "finished", [6, "iter_0000006"]], ["close"]]
    assert json.loads((tmp_path / "resumed.json").read_text()) == resumed
    assert read_train_state(tmp_path / "finished", 6)["callbacks"]["recorder"] == {"ends": 6}
    # --inject-nan grad@2-3 --max-bad-steps 1: steps 2 and 3 bad (NaN norms: no callback is asked to veto), the save
    # point of step 3 raises
    failed = [["start", 0], ["step_start", 0], ["pre_optim", 0, report], ["veto?", 0], ["post", 1, False],
              ["step_end", 1, None, None], ["save", 1, None, [1, None]],
              ["step_start", 1], ["pre_optim", 1, report], ["post", 2, True], ["step_end", 2, [2, 2, True], 2],
              ["save", 2, None, [2, None]],
              ["step_start", 2], ["pre_optim", 2, report], ["post", 3, False], ["step_end", 3, None, 2],
              ["failure", 3, "BadStepsError", [3, None]],
              ["close"], ["raised", "BadStepsError"]]
    assert json.loads((tmp_path / "failed.json").read_text()) == failed


def test_a_checkpoint_from_before_callbacks_kept_state_gives_the_spike_check_its_window():
    """Checkpoints written before the callbacks kept their own state have the spike detector's at the
    top of the train state: read into the spike callback's state, which a resumed run loads."""
    old = {"iteration": 7, "skipped_steps": 1, "spike_window": [1.0, 2.0], "spikes": 3, "rewinds": 1}
    state = TrainState.from_saved(old)
    assert state.callbacks == {"spikes": {"window": [1.0, 2.0], "spikes": 3, "rewinds": 1}} and state.skipped_steps == 1
    training = SimpleNamespace(spike_policy="warn", spike_factor=10.0, spike_window=2, max_rewinds=3)
    spikes = Spikes(training, None)
    Callbacks([spikes]).start(state)
    assert spikes.state_dict() == {"window": [1.0, 2.0], "spikes": 3, "rewinds": 1}
    assert TrainState.from_saved({"iteration": 2}).callbacks == {}  # new checkpoints: their own key, or none
