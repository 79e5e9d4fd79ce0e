"""``stopping.torchrun`` in a process of its own, for tests/test_operations.py: ``python
tests/launch_torchrun.py STOP_TIMEOUT|none older|current TORCHRUN_ARGS...``. ``older``: as under a
torchrun from before ``--signals-to-handle`` (pytorch PR #160690): this torch's own torchrun, the
option gone from its parser (``without_signals_option``), so that it refuses the option as an older
one does and handles SIGTERM, SIGINT, SIGHUP and SIGQUIT itself, as an older one always did."""

import sys

from torch.distributed import run

from fbt_megatron.trainer import stopping


def without_signals_option(parser):
    """torchrun's parser without ``--signals-to-handle`` (unknown: refused), its value the four
    signals torchrun handled before the option existed."""
    action = parser._option_string_actions["--signals-to-handle"]
    for option in action.option_strings:
        del parser._option_string_actions[option]
    parser._actions.remove(action)
    for group in parser._action_groups:
        if action in group._group_actions:
            group._group_actions.remove(action)
    parser.set_defaults(signals_to_handle=action.default)
    return parser


if __name__ == "__main__":
    stop_timeout, older, argv = sys.argv[1], sys.argv[2] == "older", sys.argv[3:]
    if older:
        parser_of_this_torch = run.get_args_parser
        run.get_args_parser = lambda: without_signals_option(parser_of_this_torch())
    sys.exit(stopping.torchrun(argv, stop_timeout=None if stop_timeout == "none" else float(stop_timeout)))
