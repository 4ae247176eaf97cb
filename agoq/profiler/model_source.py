"""The model a profile is made of: a preset, a HuggingFace config.json, or `package.module:function`.

`load_model(spec)` builds it with fresh weights (nothing is downloaded); `next_token_loss` runs any of
them on token ids; `layer_shape` reads the activation sizes of its decoder layers from the layers
themselves, so models without a config object work too.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from agoq.runtime.activations.activation_bytes import LayerShape
from agoq.runtime.activations.saved_bytes import find_decoder_layers
from agoq.files import read_json_object
from agoq.units import dtype_from_name

HF_FAMILIES = ("llama", "mistral", "qwen2")
_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def _hf_model(config: dict, path: Path) -> nn.Module:
    """A transformers model with fresh weights for a Mistral / Qwen2 config.json."""
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{path}: model_type {config['model_type']!r} needs the transformers package "
                         "(pip install 'agoq[hf]')") from None
    try:
        hf_config = transformers.AutoConfig.for_model(**config)
        return transformers.AutoModelForCausalLM.from_config(hf_config)
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: transformers cannot build a model from this config: {e}") from None


def _from_factory(spec: str) -> nn.Module:
    module_name, func_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"model {spec!r}: cannot import module {module_name!r}: {e}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"model {spec!r}: module {module_name!r} has no function {func_name!r}")
    model = func()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {spec!r}: {func_name}() returned {type(model).__name__}, not a torch nn.Module")
    return model


def _check_num_layers(num_layers: int, available, model: str) -> None:
    if isinstance(available, int) and num_layers > available:
        raise ValueError(f"--layers {num_layers}: model {model} has {available} decoder layers; give at most "
                         f"{available} (--layers keeps the first N, e.g. to measure part of a large model), or "
                         "leave it out for all of them")


def check_layers(spec: str, num_layers: int | None) -> None:
    """Refuse --layers that `spec` cannot take, without building anything: more layers than the preset's or the
    config file's num_hidden_layers (that would build a larger model under its name, whose fingerprint no plan
    of the model matches), or any for a factory function. An unknown spec is left to `load_model`."""
    from agoq.models import PRESETS

    if num_layers is None:
        return
    if spec in PRESETS:
        _check_num_layers(num_layers, PRESETS[spec].num_hidden_layers, spec)
    elif spec.endswith(".json") or os.path.isfile(spec):
        _check_num_layers(num_layers, read_json_object(Path(spec), "model config file").get("num_hidden_layers"),
                         spec)
    elif _FACTORY.fullmatch(spec):
        raise ValueError(f"--layers applies to presets and config files, not to {spec!r} (a function "
                         "decides its own model)")


def load_model(spec: str, *, dtype: str = "bf16", device: str = "cpu", seed: int = 0,
               num_layers: int | None = None) -> nn.Module:
    """Build the model named by `spec` on `device` in `dtype` ("bf16", "fp16", "fp32").

    spec: a preset (llama-tiny, probe, llama-3.2-1b, llama-3-8b), a path to a config.json of the LLaMA,
    Mistral or Qwen2 family, or "package.module:function" returning an nn.Module with LLaMA-style
    decoder layers. Raises ValueError / FileNotFoundError / NotImplementedError saying what is wrong.
    """
    from agoq.models import PRESETS, build

    check_layers(spec, num_layers)
    torch_dtype = dtype_from_name(dtype)
    if spec in PRESETS:
        model = build(spec, dtype=torch_dtype, device=device, seed=seed, num_layers=num_layers)
    elif spec.endswith(".json") or os.path.isfile(spec):
        path = Path(spec)
        config = read_json_object(path, "model config file")
        family = config.get("model_type", "llama")
        if family not in HF_FAMILIES:
            raise NotImplementedError(f"{path}: model_type {family!r} is not supported; agoq profiles the "
                                      f"{', '.join(HF_FAMILIES)} families")
        if num_layers is not None:
            config = {**config, "num_hidden_layers": num_layers}
        if family == "llama":
            model = build(config if "name" in config else {**config, "name": path.parent.name or path.stem},
                          dtype=torch_dtype, device=device, seed=seed)
        else:
            torch.manual_seed(seed)
            with torch.device(device):
                model = _hf_model(config, path)
            model = model.to(dtype=torch_dtype)
    elif _FACTORY.fullmatch(spec):
        torch.manual_seed(seed)
        with torch.device(device):
            model = _from_factory(spec)
        model = model.to(device=device, dtype=torch_dtype)
    else:
        raise ValueError(f"unknown model {spec!r}: give a preset ({', '.join(sorted(PRESETS))}), a path to a "
                         "HuggingFace config.json, or package.module:function returning an nn.Module")
    if not find_decoder_layers(model):
        raise NotImplementedError(f"model {spec!r} ({type(model).__name__}) has no LLaMA-style decoder layers "
                                  "(modules with self_attn, mlp, input_layernorm, post_attention_layernorm)")
    from agoq.runtime.activations.laaq import apply_activation_policy, remove_activation_policy

    apply_activation_policy(model, "int8")  # raises NotImplementedError for layers LAAQ cannot run
    remove_activation_policy(model)
    return model


def model_name(spec: str) -> str:
    """A short name for a spec: the preset, the config's folder or file stem, or the factory function."""
    if ":" in spec and not os.path.exists(spec):
        return spec.rsplit(":", 1)[1]
    path = Path(spec)
    if path.suffix == ".json":
        return path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return spec


def model_config_dict(model: nn.Module) -> dict | None:
    """The model's config as a JSON-ready dict, if it has one."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    return json.loads(json.dumps(config.to_dict(), default=str))


def layer_shape(model: nn.Module, batch: int, seq: int) -> LayerShape:
    """The activation sizes of the model's decoder layers for a micro-batch of batch x seq tokens."""
    layer = find_decoder_layers(model)[0]
    attn, mlp = layer.self_attn, layer.mlp
    head_dim = int(getattr(attn, "head_dim"))
    heads = attn.q_proj.out_features // head_dim
    kv_heads = attn.k_proj.out_features // head_dim
    elem = next(model.parameters()).element_size()
    return LayerShape(batch, seq, attn.q_proj.in_features, mlp.gate_proj.out_features, heads, kv_heads,
                      head_dim, elem)


def vocab_size(model: nn.Module) -> int:
    """Number of token ids the model's input embedding accepts."""
    return int(model.get_input_embeddings().num_embeddings) if hasattr(model, "get_input_embeddings") \
        else int(next(m for m in model.modules() if isinstance(m, nn.Embedding)).num_embeddings)


def next_token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean float32 cross-entropy of predicting ids[:, 1:] from ids[:, :-1]; the model returns logits
    (a tensor, or an object with `.logits`)."""
    out = model(ids[:, :-1])
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def token_batches(vocab: int, count: int, batch: int, seq: int, seed: int, device) -> list[torch.Tensor]:
    """`count` batches of random token ids [batch, seq + 1], the same for a seed on every device."""
    out = []
    for i in range(count):
        gen = torch.Generator().manual_seed(seed * 1000003 + i)
        out.append(torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device))
    return out
