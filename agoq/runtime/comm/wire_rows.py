"""The 8-bit all-reduce's wire format: one row per shard, its int8 codes followed by its float32 scales.

A shard of `per` blocks travels as `per * block` code bytes then `per * 4` scale bytes, so each step
of the all-reduce moves one buffer with one collective (or one copy). The quantize kernels write
straight into a row and the dequantize kernels read straight out of one: no packing copies.
Values past the end of the tensor are encoded as code 0 (the zero level) with scale 0, so they add
nothing to a sum and do not change any block's scale.
"""

from __future__ import annotations

import torch

from agoq.runtime.quant.layout import int_qmax, num_blocks
from agoq.runtime.quant.reference import dequantize_reference, quantize_reference

ZERO_CODE = int_qmax(8)  # the code of 0.0 in the symmetric 8-bit format


def row_bytes(per: int, block: int) -> int:
    """Bytes of one row holding `per` blocks of `block` values: codes plus float32 scales."""
    if block % 4:
        raise ValueError(f"the 8-bit all-reduce needs a block size that is a multiple of 4, got {block}")
    return per * (block + 4)


def split_row(row: torch.Tensor, per: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (codes [.., per*block] uint8, scales [.., per] float32) into rows [.., row_bytes] of uint8."""
    width = per * block
    return row[..., :width], row[..., width:width + 4 * per].view(torch.float32)


def quantize_into(values: torch.Tensor, row: torch.Tensor, per: int, block: int, use_triton: bool | None = None) -> None:
    """Quantize flat `values` (at most per*block of them) to 8 bits into one contiguous row."""
    n = values.numel()
    nb = num_blocks(n, block)
    codes, scales = split_row(row, per, block)
    if n:
        if values.is_cuda if use_triton is None else use_triton:
            from agoq.runtime.quant.block_triton import quantize_triton

            quantize_triton(values, 8, block, data_out=codes[:n], scales_out=scales[:nb])
        else:
            data, sc = quantize_reference(values, 8, block)
            codes[:n].copy_(data)
            scales[:nb].copy_(sc)
    if n < codes.numel():
        codes[n:].fill_(ZERO_CODE)
    if nb < per:
        scales[nb:].zero_()


def dequantize_from(row: torch.Tensor, per: int, block: int, out: torch.Tensor, divisor: int = 1,
                    use_triton: bool | None = None) -> None:
    """Write the first out.numel() values of a row into the contiguous flat `out` (its dtype), / divisor."""
    n = out.numel()
    if not n:
        return
    nb = num_blocks(n, block)
    codes, scales = split_row(row, per, block)
    sc = scales[:nb] if divisor == 1 else scales[:nb] / divisor
    if row.is_cuda if use_triton is None else use_triton:
        from agoq.runtime.quant.block_triton import dequantize_triton

        dequantize_triton(codes[:n], sc.contiguous(), 8, block, n, "int", out.dtype, out=out)
    else:
        out.copy_(dequantize_reference(codes[:n], sc, 8, block, n, "int", torch.float32))


def sum_rows_reference(rows: torch.Tensor, per: int, block: int) -> torch.Tensor:
    """float32 [per * block]: the sum over the W rows [W, row_bytes] of their dequantized values, row 0 first."""
    codes, scales = split_row(rows, per, block)
    w = rows.shape[0]
    values = (codes.reshape(w, per, block).to(torch.float32) - ZERO_CODE) * scales.reshape(w, per, 1)
    total = values[0].clone()
    for i in range(1, w):
        total += values[i]
    return total.view(-1)


def sum_rows(rows: torch.Tensor, per: int, block: int, use_triton: bool | None = None) -> torch.Tensor:
    """`sum_rows_reference` through the Triton shard-sum kernel on CUDA."""
    if not (rows.is_cuda if use_triton is None else use_triton):
        return sum_rows_reference(rows, per, block)
    from agoq.runtime.comm.shard_sum_triton import sum_shards_triton

    codes, scales = split_row(rows, per, block)
    return sum_shards_triton(codes, scales, block, ZERO_CODE)


def _triton_for(t: torch.Tensor, block: int, use_triton: bool | None) -> bool:
    if use_triton is None:
        use_triton = t.is_cuda
    return use_triton and block & (block - 1) == 0


def quantize_shards(flat: torch.Tensor, rows: list[torch.Tensor], per: int, block: int,
                    table: torch.Tensor | None = None, use_triton: bool | None = None) -> None:
    """Quantize flat `flat` into len(rows) rows of `per` blocks: shard d (values [d*per*block, ...)) into
    rows[d]. On the GPU one launch writes every row; `table` (their addresses, see
    wire_triton.row_table) may be given to avoid building it."""
    if _triton_for(flat, block, use_triton):
        from agoq.runtime.comm.wire_triton import quantize_to_rows_triton, row_table

        quantize_to_rows_triton(flat, row_table(rows, flat.device) if table is None else table, per, block)
        return
    width = per * block
    for d, row in enumerate(rows):
        quantize_into(flat[min(flat.numel(), d * width):min(flat.numel(), (d + 1) * width)], row, per, block,
                      use_triton=False)


def sum_requantize(rows: torch.Tensor, dests: list[torch.Tensor], per: int, block: int,
                   table: torch.Tensor | None = None, use_triton: bool | None = None) -> None:
    """Sum rows [W, row_bytes] in float32 (row 0 first), requantize to 8 bits, and store the row at
    every row in `dests` (on the GPU in one launch, which may store into peers' memory)."""
    if _triton_for(rows, block, use_triton):
        from agoq.runtime.comm.wire_triton import row_table, sum_requantize_rows_triton

        sum_requantize_rows_triton(rows, row_table(dests, rows.device) if table is None else table, per, block)
        return
    total = sum_rows_reference(rows, per, block)
    quantize_into(total, dests[0], per, block, use_triton=False)
    for row in dests[1:]:
        row.copy_(dests[0])


def dequantize_shards(rows: torch.Tensor, out: torch.Tensor, per: int, block: int, divisor: int = 1,
                      use_triton: bool | None = None) -> None:
    """Write rows [W, row_bytes] (row d holds shard d) into the contiguous flat `out`, scales / divisor."""
    if _triton_for(rows, block, use_triton):
        from agoq.runtime.comm.wire_triton import dequantize_rows_triton

        dequantize_rows_triton(rows, out, per, block, divisor)
        return
    width = per * block
    for d in range(rows.shape[0]):
        lo, hi = min(out.numel(), d * width), min(out.numel(), (d + 1) * width)
        dequantize_from(rows[d], per, block, out[lo:hi], divisor, use_triton=False)
