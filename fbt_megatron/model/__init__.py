"""The model: the paper's idea and the transformer it runs on.

fbt          the feedback fusion, k passes, the recurrence (the paper's names and equations)
fbt_model    the FBT on megatron-core's GPTModel, composed from ModuleSpecs
layers       the FBT layer pieces (headwise gate, sandwich norms)
config       FBTConfig: megatron-core's TransformerConfig with the FBT fields
losses       next-token loss per pass, z-loss
sequence     where positions live under SP/CP, the sharded right shift
offload      recompute inputs kept in pinned host memory from forward to backward
decode_modes standard, soft, fused(n), adaptive: the names every decoder shares
flops        model FLOPs per token of a k-pass step (the plan and MFU)
"""
