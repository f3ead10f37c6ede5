"""Numeric helpers shared by the compressed-collective checks: inputs, group maxima, identity."""

from __future__ import annotations

import torch
import torch.distributed as dist


def rank_input(rank: int, n: int, salt: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s test input: heavy-ish tails and a per-rank offset, as gradients have."""
    g = torch.Generator().manual_seed(7919 * rank + salt)
    return (torch.randn(n, generator=g) * (1 + rank) + 0.1 * rank).to(dtype)


def codec_case(gen: torch.Generator, numel: int, dtype: torch.dtype, poison: str | None,
               error_dtype: str | None, with_state: bool, state_numel: int, group: int):
    """A codec property test's input: ``numel`` Gaussian values (sd 3) in ``dtype``, one of them
    set to ``poison`` ("nan"/"inf") if given, and an error state of ``state_numel`` elements
    (sd 0.1) when ``error_dtype`` and ``with_state``, else None. Returns ``(x, state)``."""
    from lowbitcc.codec.error_state import ErrorState

    x = (torch.randn(numel, generator=gen) * 3).to(dtype)
    if poison is not None:
        x[int(torch.randint(numel, (1,), generator=gen))] = float(poison)
    state = None
    if error_dtype and with_state:
        state = ErrorState.encode(torch.randn(state_numel, generator=gen) * 0.1, error_dtype, group)
    return x, state


def codec_step(config=None) -> tuple[int, float]:
    """``(group, q)`` of a config's compressed reductions (default: from ``LOCO_*``): one
    nearest-rounding quantization errs by at most ``amax / (2 q)`` per element, with ``amax``
    that of its group. Int codes: ``q = 2**(bits-1) - 1``. MXFP4 and NVFP4: ``q = 1.5`` (an
    error of at most half E2M1's widest gap (4 to 6), 1, times a scale of at most ``amax / 3``:
    a power of two under ``amax / 3`` for MXFP4; for NVFP4 ``amax / 6`` rounded up to E4M3, at
    most ``amax * 1.125 / 6`` while the scale is a normal E4M3 number, as it is for groups
    whose amax is at least ``2**-13`` of their block's largest, every group of the tests' inputs).
    nvint3 and nvfp3: ``q = 1.5`` too (half their widest gap, 1/2 or 1, times ``amax / 3`` or
    ``amax / 4`` rounded up: at most ``0.1875 * amax`` or ``0.28125 * amax``)."""
    import lowbitcc
    from lowbitcc.codec import reference

    cfg = config or lowbitcc.LocoConfig.from_env()
    q = 1.5 if cfg.wire_format != "int" else float(reference.qmax(cfg.bits))
    return cfg.wire_group_size, q


def group_amax(x: torch.Tensor, rows: int, group: int = 128) -> torch.Tensor:
    """Per element, the max |x| of the quantization group it falls in, for a layout of ``rows``
    rows of ``ceil(n / rows)`` elements each quantized in groups of ``group``."""
    n = x.numel()
    m = -(-n // rows)
    padded = torch.zeros(rows * m, dtype=torch.float64)
    padded[:n] = x.double().abs()
    mp = -(-m // group) * group
    mat = torch.zeros(rows, mp, dtype=torch.float64)
    mat[:, :m] = padded.view(rows, m)
    amax = mat.view(-1, group).amax(dim=1, keepdim=True).expand(-1, group).reshape(rows, mp)
    return amax[:, :m].reshape(-1)[:n]


def identical_everywhere(t: torch.Tensor, gloo) -> bool:
    """Whether ``t`` has the same bytes on every rank of ``gloo``."""
    mine = t.contiguous().view(torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(gloo))]
    dist.all_gather(everyone, mine, group=gloo)
    return all(torch.equal(mine, other) for other in everyone)
