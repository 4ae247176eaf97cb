"""What the search chooses between for one (layer, kind): 16 bits, a bit width and format, or recompute,
and the exact bytes each choice keeps.

Bytes are LAAQ's (agoq.runtime.activations.activation_bytes.predict_layer_bytes): what the kind keeps with this
option while the layer's other kinds are kept at 16 bits inside LAAQ's layer. One interaction is not
additive: attention at 16 keeps its output, which is the o_proj input, so `o_proj_input` at 16 costs
nothing more while attention is 16 (`bytes`), and its full size when attention is quantized
(`bytes_unshared`).
"""

from __future__ import annotations

from dataclasses import dataclass

from agoq.runtime.activations.activation_bytes import LayerShape, predict_layer_bytes
from agoq.runtime.activations.policy import KEEP, KINDS, RECOMPUTABLE, RECOMPUTE, Setting

FORMATS = ("int", "nf4")
DEFAULT_BITS = (2, 3, 4, 5, 6, 8)


@dataclass(frozen=True)
class Option:
    """One way of keeping a kind: `option` is "16", a bit width as text, or "recompute"."""

    option: str
    bits: int  # 16, 2..8, or 0 for recompute
    format: str  # "bf16" (kept as is), "int", "nf4" or "recompute"

    @property
    def setting(self) -> Setting:
        """The ActivationPolicy setting of this option."""
        if self.option == RECOMPUTE:
            return RECOMPUTE
        return int(self.option)

    @property
    def quantized(self) -> bool:
        return self.format in FORMATS

    @property
    def label(self) -> str:
        """Short text naming the option, e.g. '4', '4-nf4', '16', 'recompute'."""
        return f"{self.option}-nf4" if self.format == "nf4" else self.option


KEEP_OPTION = Option("16", 16, "bf16")


def kind_options(kind: str, bits: list[int] | tuple[int, ...], formats: list[str] | tuple[str, ...]) -> list[Option]:
    """The options of one kind: 16, each bit width in `bits` per format (nf4 is 4-bit only), and recompute
    where agoq.runtime.activations.policy.RECOMPUTABLE allows it."""
    if kind not in KINDS:
        raise ValueError(f"unknown tensor kind {kind!r}; the kinds are {', '.join(KINDS)}")
    out = [KEEP_OPTION]
    for b in sorted(set(bits), reverse=True):
        if b == KEEP:
            continue
        for fmt in formats:
            if fmt == "nf4" and b != 4:
                continue
            out.append(Option(str(b), b, fmt))
    if kind in RECOMPUTABLE:
        out.append(Option(RECOMPUTE, 0, RECOMPUTE))
    return out


def check_bits_formats(bits: list[int], formats: list[str]) -> None:
    """Raise ValueError for bit widths outside 2..8 or unknown formats."""
    bad = [b for b in bits if not 2 <= b <= 8]
    if bad or not bits:
        raise ValueError(f"--bits: bit widths must be 2..8, got {bits}")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ValueError(f"--formats: choose among {', '.join(FORMATS)}, got {formats}")
    if "nf4" in formats and 4 not in bits:
        raise ValueError("--formats nf4 is a 4-bit codebook: include 4 in --bits")


def layer_settings(kind: str, option: Option, attention: Setting = KEEP) -> dict[str, Setting]:
    """Settings of a layer where only `kind` uses `option`, forced through LAAQ's layer."""
    settings: dict[str, Setting] = {k: KEEP for k in KINDS}
    settings["attention"] = attention
    settings[kind] = option.setting
    if all(v == KEEP for v in settings.values()):
        # an all-16 layer would run unmodified; recomputing another kind from its 16-bit source is
        # exact and does not change this kind's bytes
        other = next(k for k in RECOMPUTABLE if k != kind)
        settings[other] = RECOMPUTE
    return settings


def option_bytes(shape: LayerShape, kind: str, option: Option, block: int) -> tuple[int, int]:
    """(bytes, bytes_unshared) this kind keeps per micro-batch with `option` (see the module docstring)."""
    shared = predict_layer_bytes(shape, layer_settings(kind, option), block)[kind]
    if kind != "o_proj_input":
        return shared, shared
    return shared, predict_layer_bytes(shape, layer_settings(kind, option, attention=8), block)[kind]


def kind_shapes(shape: LayerShape, kind: str) -> list[tuple[int, ...]]:
    """Shapes of the tensors one layer keeps for `kind` (several for norm_input, attention, silu_input)."""
    B, S, C, I = shape.batch, shape.seq, shape.hidden, shape.intermediate
    H, Hkv, D = shape.num_heads, shape.num_kv_heads, shape.head_dim
    return {
        "norm_input": [(B, S, C), (B, S, C)],
        "qkv_input": [(B, S, C)],
        "attention": [(B, H, S, D), (B, Hkv, S, D), (B, Hkv, S, D)],
        "o_proj_input": [(B, S, H * D)],
        "ffn1_input": [(B, S, C)],
        "silu_input": [(B, S, I), (B, S, I)],
        "ffn2_input": [(B, S, I)],
    }[kind]


def shape_text(shapes: list[tuple[int, ...]]) -> str:
    """'2x64x64' for one tensor, '2x64x64+2x64x64' for several."""
    return "+".join("x".join(map(str, s)) for s in shapes)
