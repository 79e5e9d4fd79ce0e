"""The megatron-core release layer (fbt_megatron.common.compat), on whichever release is installed (CI runs
this on megatron-core 0.16 and on 0.19). The rest of what differs between them is covered by the
tests both CI stages run: model, training step, exact resume, parallel layouts, export."""

import json

import pytest

# metadata.json of a checkpoint folder as each release writes it
from fbt_megatron.common import compat
from fbt_megatron.trainer import checkpointing
from fbt_megatron.trainer.checkpointing import reading

METADATA = {
    "0.16": {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1},
    "0.19": {"sharded_backend": "torch_dist", "sharded_backend_version": 1},
}


def test_a_checkpoint_this_megatron_core_cannot_read_is_one_line(tmp_path):
    """0.19 reads both formats; 0.16 cannot read 0.19's and says so in one line with the fix."""
    from megatron.core.dist_checkpointing import serialization

    folders = {}
    for release, metadata in METADATA.items():
        folders[release] = tmp_path / release
        folders[release].mkdir()
        (folders[release] / "metadata.json").write_text(json.dumps(metadata))
    assert compat.newer_checkpoint(folders["0.16"]) is None
    if hasattr(serialization, "_legacy_common_state_exists"):  # 0.19
        assert compat.newer_checkpoint(folders["0.19"]) is None
    else:
        with pytest.raises(checkpointing.CheckpointError) as error:
            reading._common(folders["0.19"])
        assert str(error.value).endswith("cannot read: load it with megatron-core 0.19 (Python 3.12, requirements-mcore-latest.txt)")
