"""torch.compile per decoder layer, as torchtitan compiles per block: each layer is its own compiled region.

Every agoq kernel a layer runs is a torch operator (`agoq::rms_norm`, `agoq::swiglu`, `agoq::quantize_block`,
`agoq::dequantize_block` and their backwards) and LAAQ's autograd functions trace whole, so a layer under any
activation policy, recomputing or checkpointed, compiles to one graph. Apply the policy (and checkpointing)
first or after: the compiled layer calls whatever `forward` the layer has, and recompiles when it changes.
"""

from __future__ import annotations

from torch import nn

from agoq.activations.saved_bytes import find_decoder_layers


def compile_decoder_layers(model: nn.Module, **options) -> int:
    """Compile each decoder layer of `model` on its own (`nn.Module.compile(**options)`, e.g. backend="inductor");
    the embedding, final norm and loss stay eager. Returns the number of layers compiled."""
    layers = find_decoder_layers(model)
    for layer in layers:
        layer.compile(**options)
    return len(layers)
