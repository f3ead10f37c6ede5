"""Helpers shared by the schedules: column chunks, row slices of a source, stage names."""

from __future__ import annotations

import torch

from lowbitcc.compressor import CallCompressor, Source


def chunks(m: int, chunk: int, group_size: int) -> list[tuple[int, int]]:
    """Column ranges ``[a, b)`` covering ``[0, m)``: one range if ``chunk`` is 0 or ``m`` fits.

    Ranges are multiples of ``group_size`` wide (but the last), so quantization groups never
    straddle a chunk edge."""
    if chunk <= 0 or m <= chunk:
        return [(0, m)]
    width = -(-chunk // group_size) * group_size
    return [(a, min(a + width, m)) for a in range(0, m, width)]


def chunk_width(m: int, chunk_size: int, max_chunks: int) -> int:
    """The chunk width for rows of ``m`` elements under `LocoConfig`'s ``chunk_size`` (0: no
    chunks) and ``max_chunks``: ``chunk_size``, widened to ``ceil(m / max_chunks)`` where that
    is wider (``max_chunks`` 0: never), so that a row has at most ``max_chunks`` chunks."""
    if chunk_size <= 0 or max_chunks <= 0:
        return max(chunk_size, 0)
    return max(chunk_size, -(-m // max_chunks))


def into(out: torch.Tensor | None, reduced: torch.Tensor) -> torch.Tensor:
    """A reduce-scatter's result ``reduced`` (fp32 ``[m]``), in ``out`` where the caller gave
    one."""
    if out is None:
        return reduced
    out.copy_(reduced)
    return out


def stage(name: str, k: int, count: int) -> str:
    """Chunk ``k``'s stage name (``name`` itself when there is one chunk)."""
    return name if count == 1 else f"{name}.{k}"


def row_slice(source: Source, row: int, a: int, b: int) -> Source:
    """Columns ``[a, b)`` of row ``row`` of ``source`` as a one-row source (a view, no copy)."""
    flat, m = source.tensor, source.m
    lo, hi = min(row * m + a, flat.numel()), min(row * m + b, flat.numel())
    return Source(flat[lo:hi], 1, b - a, source.factor)


def all_values(source: Source, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every row of ``source`` times ``factor``: fp32 ``[rows * m]`` (zero past the end), in
    ``out`` where given (any content)."""
    flat = source.tensor
    given = out is not None
    if out is None:
        out = torch.zeros(source.rows * source.m, dtype=torch.float32, device=flat.device)
    n = min(flat.numel(), out.numel())
    out[:n] = flat[:n]
    if given and n < out.numel():
        out[n:].zero_()
    if source.factor != 1.0:
        out *= source.factor
    return out


def row_values(source: Source, row: int, a: int, b: int) -> torch.Tensor:
    """Columns ``[a, b)`` of row ``row`` times ``factor``: fp32 ``[b - a]`` (zero past the end)."""
    return all_values(row_slice(source, row, a, b))


def encode_columns(comp: CallCompressor, name: str, source: Source, a: int, b: int) -> torch.Tensor:
    """Messages ``[rows, P]`` for columns ``[a, b)`` of every row; a chunk encodes each row's
    slice in place (a view, no copy of the input) with its own stage ``name.row``."""
    rows, m = source.rows, source.m
    if (a, b) == (0, m):
        return comp.encode(name, source, list(range(rows)))
    return torch.cat([encode_row(comp, name, source, r, a, b) for r in range(rows)])


def encode_row(comp: CallCompressor, name: str, source: Source, row: int, a: int,
               b: int) -> torch.Tensor:
    """The message ``[1, P]`` of columns ``[a, b)`` of row ``row``, encoded in place (a view)
    with chunk stage ``name``'s own stage for the row, ``name.row``."""
    return comp.encode(f"{name}.{row}", row_slice(source, row, a, b), [row])


def decode_columns(comp: CallCompressor, messages: torch.Tensor, source_rows: int, m: int,
                   a: int, b: int, out: torch.Tensor) -> None:
    """Decode ``messages`` ``[rows, P]`` (row ``r``: columns ``[a, b)`` of row ``r``) into the
    matching places of flat ``out`` (``rows * m`` elements, clipped to its length)."""
    if (a, b) == (0, m):
        comp.decode_into(messages, m, list(range(source_rows)), out)
        return
    for r in range(source_rows):
        lo, hi = min(r * m + a, out.numel()), min(r * m + b, out.numel())
        comp.decode_into(messages[r:r + 1], b - a, [r], out[lo:hi])
