"""Worker of tests/test_callbacks.py (one rank, tests/forked.py): two real runs of the training loop
(``trainer.loop.train``) with a recording callback registered after the recipe's, one that ends
and one stopped by too many NaN steps (``BadStepsError``), then the first resumed (its recorder's
state back from the checkpoint). Each hook it sees is written, in
order, to ``OUT/<run>.json``, with what the recipe's callbacks had done by then (the
``metrics.jsonl`` record of the step, the memory in it, the heartbeat's step and checkpoint); what it
adds to a logged step's record (``post_step``) comes back in the record.

    python tests/distributed/callbacks_worker.py CORPUS OUT
"""

import json
import sys
from pathlib import Path

FLAGS = ["--recipe", "recipes/tiny_cpu.yaml", "--corpus", "null", "--seq-length", "64", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr-warmup-iters", "1", "--threads", "1", "--train-iters", "4", "--log-interval", "2",
         "--eval-iters", "0", "--save-interval", "2", "--heartbeat-interval", "0", "--tensorboard", "false",
         "--spike-policy", "rewind"]


def recorder(save: Path):
    from fbt_megatron.trainer.callbacks.base import Callback
    from fbt_megatron.trainer.callbacks.heartbeat import read_heartbeat
    from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics

    def heartbeat():
        beat = read_heartbeat(save)
        return beat and [beat["step"], beat["last_checkpoint"]]

    class Recorder(Callback):
        name = "recorder"  # its state's key in a checkpoint

        def __init__(self):
            self.events, self.ends = [], 0  # its state: the step ends it has seen, a resumed run's included

        def state_dict(self):
            return {"ends": self.ends}

        def load_state_dict(self, state_dict):
            self.ends = state_dict["ends"]
            self.events.append(["loaded", state_dict])

        def pre_optim_step(self, state, report):
            self.events.append(["pre_optim", state.iteration, "pass_losses" in report])

        def vetoes_update(self, state, grad_norm):
            self.events.append(["veto?", state.iteration])
            return False

        def on_start(self, state):
            self.events.append(["start", state.iteration])

        def on_step_start(self, state, k):
            self.events.append(["step_start", state.iteration])

        def post_step(self, state, result):
            self.events.append(["post", state.iteration, result.logged])
            return {"mark": state.iteration} if result.logged else {}  # into the step's record

        def on_step_end(self, state, record):
            self.ends += 1
            logged = read_metrics(save)
            self.events.append(["step_end", state.iteration, record and [record["step"], record["mark"], "max_rss_bytes" in record],
                                logged[-1]["step"] if logged else None])

        def on_save(self, state, checkpoint):
            self.events.append(["save", state.iteration, checkpoint and checkpoint.name, heartbeat()])

        def on_stop(self, state, reason):
            self.events.append(["stop", state.iteration, reason, heartbeat()])

        def on_failure(self, state, error):
            self.events.append(["failure", state.iteration, type(error).__name__, heartbeat()])

        def close(self):
            self.events.append(["close"])

    return Recorder()


def main():
    from fbt_megatron.commands import train
    from fbt_megatron.trainer import loop

    corpus, out = sys.argv[1], Path(sys.argv[2])
    runs = {"finished": [], "failed": ["--inject-nan", "grad@2-3", "--max-bad-steps", "1"],
            "resumed": ["--load", str(out / "finished"), "--train-iters", "6", "--use-checkpoint-opt-param-scheduler"]}
    for name, flags in runs.items():
        save = out / ("finished" if name == "resumed" else name)
        callback = recorder(save)
        try:
            loop.train(train.parse_args([*FLAGS, "--data-path", corpus, "--save", str(save), *flags]), callbacks=[callback])
        except Exception as e:
            callback.events.append(["raised", type(e).__name__])
        (out / f"{name}.json").write_text(json.dumps(callback.events))


if __name__ == "__main__":
    main()
