"""The fused 8-bit AdamW step: plain torch reference (the CPU path, the kernel's oracle) and the dispatcher.

State format (that of AdamW8bit, unchanged): per parameter of n values, `exp_avg_codes` and
`exp_avg_sqrt_codes` (uint8, ceil(n / block) * block float8 e4m3fn codes) with `exp_avg_scales` and
`exp_avg_sqrt_scales` (float32, one per block of `block` values, = block absmax / 448, 1 for an
all-zero block). The first moment m is stored as it is, the second as r = sqrt(v).

One step, per value, every operation in float32 and rounded on its own (t = step, counted from 1):

    g      = gradient * clip                       (QuanGrad: (code - 127) * scale, then * clip)
    m      = beta1 * m_old + (1 - beta1) * g
    v      = beta2 * r_old**2 + (1 - beta2) * g**2 ;  r = sqrt(v)
    p      = p * (1 - lr * wd) - (lr / (1 - beta1**t)) * m / (r / sqrt(1 - beta2**t) + eps)

torch.optim.AdamW's update (decoupled weight decay, eps added to the bias-corrected sqrt(v)), with the
clip factor multiplied into the gradient. p is the float32 master when there is one (the bf16
parameter then receives it rounded to nearest even); without a master a bf16 parameter receives p
rounded stochastically: its float32 bits plus 16 uniform random low bits, truncated (unbiased:
E[bf16] = p). m and r are requantized per block. The scalars are rounded to float32 first.

The reference walks a parameter in chunks of CHUNK values, so its float32 temporaries are bounded
(never a copy of the model); on the GPU `adamw_step_triton` does a whole bucket in one launch.
"""

from __future__ import annotations

import math

import torch

from agoq.runtime.comm.quangrad import QuantizedGradients

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
CHUNK = 2**20  # values per piece of the reference's walk (a multiple of every power-of-two block <= 2**20)
BUCKET_VALUES = 2**26  # values per kernel launch, at most (a larger parameter is a launch of its own)


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes [n padded to blocks], float32 scales [blocks]) of a flat float tensor, float8 e4m3 per block."""
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    return _quantize_rows(padded.view(blocks, block))


def zero_blocks(n: int, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """What `quantize_blocks` stores for `n` zeros, made directly: e4m3's code of 0 is the byte 0, and a block
    whose absmax is 0 has scale 1. A fresh moment of a large parameter (an embedding of 0.5 G values) then takes
    its 1 byte per value and nothing more, where quantizing float32 zeros held 12 bytes per value for a moment."""
    blocks = -(-n // block)
    return (torch.zeros(blocks * block, dtype=torch.uint8, device=device),
            torch.ones(blocks, dtype=torch.float32, device=device))


def _quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    absmax = rows.abs().amax(dim=1)
    scales = torch.where(absmax > 0, _div(absmax, FP8_MAX), torch.ones_like(absmax))
    inverse = torch.ones_like(scales) / scales  # one correctly rounded division per block, then products
    codes = (rows * inverse.unsqueeze(1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return codes.view(torch.uint8).reshape(-1), scales


def _div(x: torch.Tensor, s: float) -> torch.Tensor:
    """x / s correctly rounded (torch divides by a scalar as a product with its reciprocal)."""
    return x / torch.full_like(x, s)


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, numel: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The flat tensor of `numel` values that `quantize_blocks` stored, in `dtype`."""
    rows = codes.view(FP8).view(scales.numel(), -1).to(dtype)
    return (rows * scales.to(dtype).unsqueeze(1)).reshape(-1)[:numel]


def f32(x: float) -> float:
    """x rounded to the nearest float32 (the kernel receives float32 scalars; the reference uses the same)."""
    return torch.tensor(x, dtype=torch.float32).item()


def step_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                 clip: float) -> dict:
    """The float32 scalars of step `step` (from 1): see the module docstring."""
    return {"beta1": f32(beta1), "beta2": f32(beta2), "omb1": f32(1.0 - beta1), "omb2": f32(1.0 - beta2),
            "decay": f32(1.0 - lr * weight_decay), "step_size": f32(lr / (1.0 - beta1 ** step)),
            "inv_bc2_sqrt": f32(1.0 / math.sqrt(1.0 - beta2 ** step)), "eps": f32(eps), "clip": f32(clip)}


def sr_seed(seed: int, step: int, index: int) -> int:
    """The stochastic-rounding seed of parameter `index` at step `step`: a fresh stream per parameter and step,
    a function of the optimizer's seed only (so a resumed run draws what the uninterrupted one drew)."""
    return (seed * 1_000_003 + step * 65_537 + index * 7_919) % (2**31 - 1)


def stochastic_round_bf16(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """bf16 of float32 `x`: its bits plus `noise` (int32 in [0, 2**16)), truncated to the high 16 bits.
    Rounds up with probability equal to the dropped fraction, hence E[result] = x (away from overflow)."""
    bits = x.contiguous().view(torch.int32)
    out = ((bits + noise) >> 16).to(torch.int16)
    nan = x != x
    if nan.any():
        out = torch.where(nan, ((bits | 0x400000) >> 16).to(torch.int16), out)
    return out.view(torch.bfloat16)


def _sr_noise(n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randint(0, 2**16, (n,), generator=generator, dtype=torch.int32, device=device)


def adamw_chunk_reference(g: torch.Tensor, p: torch.Tensor, m_codes: torch.Tensor, m_scales: torch.Tensor,
                          r_codes: torch.Tensor, r_scales: torch.Tensor, n: int, sc: dict) -> torch.Tensor:
    """One piece of a parameter: `g` and `p` float32 [L] (L whole blocks, values >= n are padding), the
    moments' codes [L] and scales [L / block] updated in place; returns the new float32 p (the docstring's
    arithmetic, one rounding per operation, as the kernel)."""
    blocks = m_scales.numel()
    g = g * sc["clip"]
    m_old = (m_codes.view(FP8).float().view(blocks, -1) * m_scales[:, None]).reshape(-1)
    r_old = (r_codes.view(FP8).float().view(blocks, -1) * r_scales[:, None]).reshape(-1)
    m = m_old * sc["beta1"] + g * sc["omb1"]
    v = (r_old * r_old) * sc["beta2"] + (g * g) * sc["omb2"]
    r = v.double().sqrt().float()  # correctly rounded (torch's float32 sqrt on the CPU may not be)
    if n < g.numel():
        m[n:] = 0.0
        r[n:] = 0.0
    denom = r * sc["inv_bc2_sqrt"] + sc["eps"]
    upd = (m * sc["step_size"]) / denom
    p = p * sc["decay"] - upd
    codes, scales = _quantize_rows(m.view(blocks, -1))
    m_codes.copy_(codes)
    m_scales.copy_(scales)
    codes, scales = _quantize_rows(r.view(blocks, -1))
    r_codes.copy_(codes)
    r_scales.copy_(scales)
    return p


def _grad_piece(grad, a: int, b: int, length: int, grad_block: int) -> torch.Tensor:
    """float32 [length] gradient values a..a+length of one parameter (zeros past b), from dense or QuanGrad."""
    out = torch.zeros(length, dtype=torch.float32, device=(grad[0] if isinstance(grad, tuple) else grad).device)
    if isinstance(grad, tuple):
        codes, scales = grad
        idx = torch.arange(a, b, device=codes.device) // grad_block
        out[: b - a] = (codes[a:b].to(torch.int32) - 127).float() * scales[idx]
    else:
        out[: b - a] = grad.reshape(-1)[a:b].float()
    return out


def adamw_step_reference(params: list[torch.Tensor], masters: list[torch.Tensor] | None, grads: list,
                         states: list[dict], sc: dict, *, block: int, grad_block: int,
                         seeds: list[int] | None) -> None:
    """The step over parameters one at a time, CHUNK values at a time (see the module docstring)."""
    for i, (p, g, st) in enumerate(zip(params, grads, states)):
        n = p.numel()
        flat_p = p.view(-1)
        master = masters[i].view(-1) if masters is not None else None
        stochastic = seeds is not None and master is None and p.dtype == torch.bfloat16
        gen = torch.Generator(device=p.device).manual_seed(seeds[i]) if stochastic else None
        for a in range(0, n, CHUNK):
            b = min(n, a + CHUNK)
            length = -(-(b - a) // block) * block
            gp = _grad_piece(g, a, b, length, grad_block)
            pp = torch.zeros(length, dtype=torch.float32, device=p.device)
            pp[: b - a] = (master if master is not None else flat_p)[a:b].float()
            blocks = slice(a // block, a // block + length // block)
            new = adamw_chunk_reference(gp, pp, st["exp_avg_codes"][a:a + length], st["exp_avg_scales"][blocks],
                                        st["exp_avg_sqrt_codes"][a:a + length], st["exp_avg_sqrt_scales"][blocks],
                                        b - a, sc)[: b - a]
            if master is not None:
                master[a:b] = new
            if stochastic:
                flat_p[a:b] = stochastic_round_bf16(new, _sr_noise(b - a, gen, p.device))
            else:
                flat_p[a:b] = new.to(p.dtype)


def _kind(grad) -> object:
    return "quangrad" if isinstance(grad, tuple) else grad.dtype


def adamw8bit_step(params: list[torch.Tensor], masters: list[torch.Tensor] | None, grads: list,
                   states: list[dict], *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                   step: int, clip: float = 1.0, block: int = 256, grad_block: int = 256,
                   seeds: list[int] | None = None, backend: str = "auto") -> None:
    """AdamW step `step` (from 1) over parameters with 8-bit moments, in place: `states` (AdamW8bit's
    per-parameter dicts), `masters` (float32, or None), `params`.

    `grads[i]` is a dense tensor (any of float32 / bf16 / float64) or QuanGrad's (codes, scales) of the
    parameter (`grad_block` values per scale). `seeds` (one per parameter, see `sr_seed`) turns on
    stochastic rounding of bf16 parameters that have no master. backend: "auto" (Triton on CUDA tensors,
    the torch reference elsewhere), "triton" (also CPU tensors under TRITON_INTERPRET=1) or "reference".
    """
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be auto, triton or reference, got {backend!r}")
    if not params:
        return
    sc = step_scalars(lr, betas[0], betas[1], eps, weight_decay, step, clip)
    if backend == "reference" or (backend == "auto" and params[0].device.type != "cuda"):
        adamw_step_reference(params, masters, grads, states, sc, block=block, grad_block=grad_block, seeds=seeds)
        return
    groups: dict[tuple, list[int]] = {}
    for i, (p, g) in enumerate(zip(params, grads)):
        groups.setdefault((p.dtype, _kind(g)), []).append(i)
    from agoq.runtime.optim.fused_adamw_triton import adamw_step_triton  # Triton is imported only when a kernel runs
    for members in groups.values():
        bucket: list[int] = []
        size = 0
        for i in members + [None]:
            n = -(-params[i].numel() // block) * block if i is not None else 0
            if bucket and (i is None or size + n > BUCKET_VALUES):
                adamw_step_triton([params[k] for k in bucket], [masters[k] for k in bucket] if masters else None,
                                  [grads[k] for k in bucket], [states[k] for k in bucket], **sc, block=block,
                                  grad_block=grad_block, seeds=[seeds[k] for k in bucket] if seeds else None)
                bucket, size = [], 0
            if i is not None:
                bucket.append(i)
                size += n


def grad_norm_sq(grads: QuantizedGradients | list[torch.Tensor], backend: str = "auto") -> torch.Tensor:
    """Squared L2 norm (float64 0-d tensor, on the gradients' device) of all gradients, in one reduction over
    what is stored: QuanGrad's whole buffer (sum over blocks of scale**2 * sum((code - 127)**2), padding
    codes are zeros) or dense tensors (no float32 copies: the kernel squares in registers)."""
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be auto, triton or reference, got {backend!r}")
    if isinstance(grads, QuantizedGradients):
        grads.wait()
        codes, scales, block = grads.codes, grads.scales, grads.block
        if backend == "triton" or (backend == "auto" and codes.is_cuda):
            from agoq.runtime.optim.fused_adamw_triton import codes_norm_sq_triton
            return codes_norm_sq_triton(codes, scales, block)
        total = torch.zeros((), dtype=torch.float64, device=codes.device)
        for a in range(0, scales.numel(), CHUNK // block):  # bounded temporaries
            c = codes[a * block:(a + CHUNK // block) * block].view(-1, block).to(torch.int32) - 127
            s = scales[a:a + CHUNK // block].double()
            total += ((c * c).sum(dim=1).double() * s * s).sum()
        return total
    grads = list(grads)
    if not grads:
        raise ValueError("grad_norm_sq needs at least one gradient")
    if backend == "triton" or (backend == "auto" and grads[0].is_cuda):
        from agoq.runtime.optim.fused_adamw_triton import dense_norm_sq_triton
        return dense_norm_sq_triton(grads)
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    for g in grads:
        flat = g.reshape(-1)
        for a in range(0, flat.numel(), CHUNK):
            piece = flat[a:a + CHUNK].double()
            total += (piece * piece).sum()
    return total
