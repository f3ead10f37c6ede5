"""What is wrong with a c10d call's arguments, found before the call is issued.

Each check returns the problem (None: none) or raises what gloo or NCCL would raise, so that the
process group can refuse a call on every rank (`process_group`: `_refuse`) instead of leaving
the others waiting; the helpers count a call's tensors and bytes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lowbitcc.backend.exact import op_type


def flat(tensors: list[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for t in tensors:
        out.extend(flat(t) if isinstance(t, list | tuple) else [t])
    return out


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def op_problem(op: Any, tensors: list[torch.Tensor]) -> TypeError | None:
    """The error of a reduction by ``op`` of ``tensors`` that NCCL refuses and gloo lacks:
    PREMUL_SUM on tensors that are not floating point (None: none)."""
    if op_type(op) != dist.ReduceOp.PREMUL_SUM:
        return None
    for t in tensors:
        if not t.dtype.is_floating_point:
            return TypeError(f"lowbitcc: PREMUL_SUM needs floating-point tensors (as on NCCL), "
                             f"got {t.dtype}")
    return None


def holds_problem(output: torch.Tensor, source: torch.Tensor, size: int) -> str | None:
    """What is wrong with ``output`` as the all-gather of ``size`` tensors like ``source``, as
    gloo would refuse it; None: nothing."""
    if output.numel() == source.numel() * size and output.dtype == source.dtype:
        return None
    return (f"an output of {output.numel()} {output.dtype} elements does not hold {size} inputs "
            f"of {source.numel()} {source.dtype}")


def scatter_list_problem(output: torch.Tensor, inputs: list[torch.Tensor],
                         size: int) -> str | None:
    """What is wrong with a list reduce-scatter of ``inputs`` into ``output`` on ``size``
    ranks (None: nothing)."""
    if len(inputs) != size:
        return f"lowbitcc: reduce_scatter needs {size} input tensors, got {len(inputs)}"
    if any(t.shape != output.shape or t.dtype != output.dtype for t in inputs):
        return "lowbitcc: reduce_scatter inputs must all match the output's shape and dtype"
    return None


def scatter_flat_problem(outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                         size: int) -> str | None:
    """What is wrong with flat reduce-scatters of ``inputs`` into ``outputs`` (pairwise) on
    ``size`` ranks (None: nothing)."""
    for out, inp in zip(outputs, inputs):
        if inp.numel() != out.numel() * size or inp.dtype != out.dtype:
            return (f"lowbitcc: reduce_scatter input of {inp.numel()} {inp.dtype} elements "
                    f"does not hold {size} outputs of {out.numel()} {out.dtype} elements")
    return None


def list_problem(name: str, lists: list[list[torch.Tensor]], like: list[torch.Tensor],
                  size: int) -> str | None:
    """What is wrong with ``lists`` (one list of ``size`` tensors per tensor of ``like``, each
    of its shape and dtype), as gloo would refuse it; None: nothing."""
    if len(lists) != len(like):
        return f"{len(lists)} {name} lists for {len(like)} tensors"
    for entries, t in zip(lists, like):
        if len(entries) != size:
            return f"an {name} list of {len(entries)} tensors in a group of {size}"
        for i, e in enumerate(entries):
            if e.shape != t.shape or e.dtype != t.dtype:
                return (f"{name} tensor {i} is {e.dtype} {tuple(e.shape)}, expected "
                        f"{t.dtype} {tuple(t.shape)}")
    return None


def check_tensors(what: str, tensors: list[Any]) -> str:
    """The one device type of ``tensors`` ("cpu" for none); raises on anything else."""
    types = set()
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"lowbitcc: {what} expects tensors, got {type(t).__name__}")
        types.add(t.device.type)
    if len(types) > 1:
        raise ValueError(f"lowbitcc: {what} got tensors on several device types "
                         f"({', '.join(sorted(types))}); one call takes one")
    device_type = types.pop() if types else "cpu"
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"lowbitcc: {what} got a {device_type} tensor; the 'loco' backend serves "
                         "CPU and CUDA tensors")
    return device_type
