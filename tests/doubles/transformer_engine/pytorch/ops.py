"""TE's fusible operations: megatron-core names them in annotations at import (``TEFusedMLP``); the
FBT model does not build them, and the double refuses to."""


class FusibleOperation:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the TE double does not model TE's fusible operations (te.pytorch.ops)")


class Sequential(FusibleOperation):
    pass
