"""The paper's diagnostics of trained runs, each a JSON of its numbers, a PNG and a short summary:

    python -m fbt_megatron.diagnostics fixed-point --load RUN --output DIR [--max-passes 64]
    python -m fbt_megatron.diagnostics prefill     --load RUN [RUN ...] --output DIR [--fused-passes 3]
    python -m fbt_megatron.diagnostics probes      --load ST_RUN --output DIR [--fused-passes 1 2 3]
    python -m fbt_megatron.diagnostics generation  --load ST_RUN --output DIR [--fused-passes 1 2 3]

fixed-point  ‖Δs‖ = RMS(s^{(j)} − s^{(j−1)}) and the validation loss against pass j (Fig. 3)
prefill      validation loss after n = 0 … N fused prefill passes, baselines as lines (Fig. 4);
             with the run's own validation batches it reproduces the losses training logged
probes       linear probes per layer of a state-tracking run: test accuracy of the state from each
             layer's output, standard (pass 1) against n fused passes (Sec. 4.4)
generation   state-tracking accuracy by position under real decoding with the KV cache:
             standard, soft, fused(n) (``fbt_megatron.inference.generate.forced_logits``)

One module per diagnostic; ``common`` holds what they share (loading, the validation batches,
the outputs).
"""
