"""agoq's training runtime: the kernels and the modules that run a plan, each beside its plain reference.

  quant        block-wise quantization (int and NF4 codes, stochastic rounding), Triton kernels and torch references
  activations  LAAQ: activations saved for backward at a bit width per layer and kind, recomputed, checkpointed or
               offloaded to host memory
  comm         QuanGrad's 8-bit all-reduce, SDP4Bit's TLq-HS reduce-scatter and qWD all-gather, FSDP2's collectives
  optim        fused AdamW and 8-bit AdamW, optimizer state bytes
"""
