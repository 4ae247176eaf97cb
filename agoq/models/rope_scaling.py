"""RoPE scalings as ``config.json`` files write them: the ``rope_type`` variants agoq takes, their checked and
normalised form (what ``LlamaConfig.rope_scaling`` holds) and the constant their cos/sin tables are multiplied by.

The frequencies themselves, and the formulas of every variant, are in agoq.models.rope; this module imports no
torch, so reading a model's config (the search does) does not load it.
"""

from __future__ import annotations

import math
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# per type: required parameters, optional parameters (besides rope_type / rope_theta)
_PARAMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("original_max_position_embeddings",),
             ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"),
                 ("factor", "attention_factor")),
}
_NEEDS_ORIGINAL = ("llama3", "yarn", "longrope")


def _number(key: str, where: str, value: Any, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and not value > 0):
        raise ValueError(f"{where}: {key} must be a {'positive ' if positive else ''}number, got {value!r}")
    return float(value)


def normalize_rope_scaling(rope: dict[str, Any], *, where: str, max_position_embeddings: int,
                           original_max_position_embeddings: Any = None) -> dict[str, Any] | None:
    """Check a ``rope_scaling`` / ``rope_parameters`` dict and return its normalised form (None: plain RoPE).

    ``where`` names the dict in error messages. ``original_max_position_embeddings`` is a top-level value of
    the config file, which (as in transformers) takes precedence over the one inside the dict; when neither is
    given, the types that need it take ``max_position_embeddings``.
    """
    if not isinstance(rope, dict):
        raise ValueError(f"{where} must be a dict or null, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"{where} with rope_type {rope_type!r} is not supported: the supported rope types are "
            f"{', '.join(repr(t) for t in SUPPORTED_ROPE_TYPES)}; remove {where} (or set it to null) to use "
            f"plain RoPE with the same shapes")
    prf = rope.get("partial_rotary_factor")
    if prf not in (None, 1, 1.0):
        raise NotImplementedError(f"{where}: partial_rotary_factor {prf!r} is not supported: this model "
                                  f"rotates the whole head (partial_rotary_factor 1)")
    if rope_type == "default":
        return None
    required, optional = _PARAMS[rope_type]
    out: dict[str, Any] = {"rope_type": rope_type}
    if rope_type in _NEEDS_ORIGINAL:
        orig = original_max_position_embeddings
        if orig is None:
            orig = rope.get("original_max_position_embeddings", max_position_embeddings)
        if isinstance(orig, float) and orig.is_integer():
            orig = int(orig)
        if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
            raise ValueError(f"{where}: original_max_position_embeddings must be a positive integer, got {orig!r}")
        out["original_max_position_embeddings"] = orig
    for key in required + optional:
        if key == "original_max_position_embeddings":
            continue
        value = rope.get(key)
        if value is None:
            if key in required:
                raise ValueError(f"{where}: rope_type {rope_type!r} needs {key!r}; it has "
                                 f"{', '.join(sorted(rope)) or 'no keys'}")
            continue
        if key in ("short_factor", "long_factor"):
            if not isinstance(value, (list, tuple)) or not value:
                raise ValueError(f"{where}: {key} must be a non-empty list of positive numbers, got {value!r}")
            out[key] = [_number(f"{key}[{i}]", where, v) for i, v in enumerate(value)]
        elif key == "truncate":
            if not isinstance(value, bool):
                raise ValueError(f"{where}: truncate must be true or false, got {value!r}")
            out[key] = value
        else:
            # beta_* and mscale* may legitimately be 0 (transformers then uses its defaults / no ratio)
            out[key] = _number(key, where, value, positive=key in ("factor", "attention_factor",
                                                                 "low_freq_factor", "high_freq_factor"))
    if rope_type == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ValueError(f"{where}: high_freq_factor ({out['high_freq_factor']}) must be greater than "
                         f"low_freq_factor ({out['low_freq_factor']})")
    return out


def check_rope_scaling_fits(scaling: dict[str, Any] | None, head_dim: int) -> None:
    """Raise ValueError when a normalised scaling does not fit the head size (longrope's factor lists)."""
    if scaling and scaling["rope_type"] == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != head_dim // 2:
                raise ValueError(f"rope scaling: {key} has {len(scaling[key])} entries, the head has "
                                 f"{head_dim // 2} frequencies (head_dim {head_dim} / 2)")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: dict[str, Any] | None, max_position_embeddings: int) -> float:
    """The constant the cos/sin tables are multiplied by (1.0 for most types)."""
    if not scaling:
        return 1.0
    kind = scaling["rope_type"]
    given = scaling.get("attention_factor")
    if kind == "yarn":
        if given is not None:
            return float(given)
        factor = scaling.get("factor") or max_position_embeddings / scaling["original_max_position_embeddings"]
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if m and m_all:
            return _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
        return _yarn_mscale(factor)
    if kind == "longrope":
        if given is not None:
            return float(given)
        orig = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or max_position_embeddings / orig
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return 1.0


__all__ = ["SUPPORTED_ROPE_TYPES", "normalize_rope_scaling", "check_rope_scaling_fits", "attention_factor"]
