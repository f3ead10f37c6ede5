"""Which calls are compressed, and under which error-feedback key.

The decision is taken in the thread that issues the collective, at the moment it is issued:

- `exact()`, `compressed()` and `compressible()` are process-wide context managers (not
  thread-local: DDP and FSDP issue their collectives from autograd's threads); the innermost
  active one wins, else the group's ``policy`` ("backward", "always" or "never") decides.
  `compressed()` forces compression; `compressible()` makes a call outside backward eligible as
  a gradient's is, and the cost model (where on) decides.
- Under "backward", a call is compressed when it is issued while autograd runs a backward pass
  (``torch._C._current_graph_task_id() >= 0``): DDP's bucket all-reduces and FSDP's gradient
  reduce-scatters are; a loss or metric all-reduce in the training loop is not.
- Only ``all_reduce`` / ``reduce_scatter`` with SUM, AVG or PREMUL_SUM on fp32, bf16 or fp16
  tensors of at least ``min_size`` elements are eligible (complex tensors travel exact).

Keys follow logical tensors: ``(group, collective, dtype, numel, ordinal)`` where the ordinal
counts calls of that signature since the current backward pass began (or, outside backward, since
the last optimizer step, counted by `lowbitcc.state`). `feedback_key` names calls explicitly
instead.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist

from lowbitcc import state

COMPRESSIBLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COMPRESSIBLE_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM)

_lock = threading.Lock()
_mode_stack: list[str] = []
_key_stack: list[list] = []  # [name, calls issued inside]


def exact() -> PolicyBlock:
    """Within this block no call is compressed, on any "loco" group of this process."""
    return PolicyBlock(_mode_stack, "never")


def compressed() -> PolicyBlock:
    """Within this block every eligible call is compressed, inside backward or not."""
    return PolicyBlock(_mode_stack, "always")


def compressible() -> PolicyBlock:
    """Within this block every eligible call may be compressed, inside backward or not, where
    the cost model (when on) finds that it pays, as for gradients in backward."""
    return PolicyBlock(_mode_stack, "auto")


def feedback_key(name: str) -> PolicyBlock:
    """Calls issued in this block use error-feedback keys ``name``, ``name#1``, ``name#2``, ...

    Use it to give a tensor a stable key outside backward, e.g. around a hand-written
    gradient all-reduce that runs once per step.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("lowbitcc.feedback_key needs a non-empty string")
    return PolicyBlock(_key_stack, [name, 0])


class PolicyBlock(contextlib.ContextDecorator):
    """A block that holds ``item`` (a mode, or a fresh copy of a ``[name, calls]`` key
    entry each time it is entered) on ``stack``, one of this module's, while it runs; usable as
    a decorator too. A class rather than a generator: training loops enter one around every
    call, and a generator's context manager costs several times as much."""

    def __init__(self, stack: list, item: str | list) -> None:
        self._stack, self._item = stack, item
        self._held: list[str | list] = []

    def __enter__(self) -> None:
        item = list(self._item) if isinstance(self._item, list) else self._item
        with _lock:
            self._stack.append(item)
        self._held.append(item)

    def __exit__(self, *exc: object) -> None:
        item = self._held.pop()
        with _lock:  # the innermost entry that is this block's (an outer one may equal it)
            at = next(i for i in range(len(self._stack) - 1, -1, -1) if self._stack[i] is item)
            del self._stack[at]

    def _recreate_cm(self) -> PolicyBlock:
        """A decorated function's calls each enter a block of their own (threads may overlap)."""
        return PolicyBlock(self._stack, self._item)


def mode(default: str) -> str:
    """The policy in force now: the innermost context's, else ``default``. Read without the
    lock (every call reads it): indexing a list is atomic, and the stack may empty meanwhile."""
    try:
        return _mode_stack[-1]
    except IndexError:
        return default


def in_backward() -> bool:
    return torch._C._current_graph_task_id() >= 0


def wants_compression(policy: str) -> bool:
    """Whether a compressible call issued now should be compressed under ``policy``."""
    active = mode(policy)
    if active == "never":
        return False
    return active in ("always", "auto") or in_backward()


def forced() -> bool:
    """Whether a `compressed()` block is the innermost active one: compression is then forced
    and the cost model not consulted."""
    return mode("") == "always"


def eligible(tensor: torch.Tensor, op: dist.ReduceOp) -> bool:
    """Op and dtype allow compression (size is checked separately, after ranks agree). A real
    view of a complex tensor (c10d hands complex tensors over as ``view_as_real``) is not
    eligible: the codes' groups would mix real and imaginary parts."""
    return (tensor.dtype in COMPRESSIBLE_DTYPES and op in COMPRESSIBLE_OPS
            and not tensor.is_sparse and not _views_complex(tensor))


def _views_complex(tensor: torch.Tensor) -> bool:
    base = tensor._base
    return base is not None and base.is_complex()


def explicit_key() -> str | None:
    """The next explicit key if a `feedback_key` block is active (and count this call)."""
    with _lock:
        if not _key_stack:
            return None
        entry = _key_stack[-1]
        name, calls = entry
        entry[1] += 1
        return name if calls == 0 else f"{name}#{calls}"


def epoch() -> tuple[str, int]:
    """What ordinals count within: the current backward pass, or the current optimizer step."""
    task = torch._C._current_graph_task_id()
    if task >= 0:
        return ("backward", task)
    return ("step", state.optimizer_steps())
