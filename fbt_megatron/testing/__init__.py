"""Test infrastructure, apart from the production rooms: nothing of the package imports it, and a run
loads it only when a test asks for it.

simulated_device   with ``FBT_SIMULATED_DEVICE=1`` the compute device of ``common.platform`` (which looks
                   it up by name then, and only then): a GPU stand-in on the CPU whose process groups
                   refuse host tensors as NCCL does (``tests/test_device_contracts.py``)
"""
