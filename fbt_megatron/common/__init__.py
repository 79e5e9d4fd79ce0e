"""The ground floor: what every other package stands on and which imports nothing above it.

errors, cli          the refusals (one line, exit 2) and how a command ends on them
io, folders          files and folders written whole (fsync, rename), the run folders' checks
platform             CPU (gloo) or GPU (NCCL), process groups, megatron-core's parallel state
compat, megatron_fixes   megatron-core's versions, its fixes
processes, seeds     child processes that end with their parent; the seeds of a run
gpus                 the accelerators the planner and MFU know (memory, peak TFLOP/s)
"""
