"""`eager_methods`: a process group's and its Works' methods run outside torch.compile.

c10d calls a Python process group from C++, and some of those calls happen while a compiled
region runs its eager parts: DDP's ``reducer._rebuild_buckets()`` in a compiled DDP's forward
broadcasts through the group, and torch.compile's frame evaluation then tries to compile the
group's Python method as a new frame and fails ("Attempted to access unregistered member on an
OpaqueObject", torch 2.13). ``torch.compiler.disable`` stops that, but importing
``torch._dynamo`` for it costs about 1.4 s per process at group creation. The same effect comes
from the two C functions it uses (`torch._C._dynamo.eval_frame`): the wrapper's own frame is
marked to be skipped, and it turns frame evaluation off for everything it calls, restoring
the caller's callback after: about 0.15 us a wrapped call here (189 against 45 ns for a bare
Python call). Where those functions are missing (another torch), the methods are left as they
are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T", bound=type)


def _set_eval_frame() -> Callable[[Any], Any] | None:
    try:
        from torch._C._dynamo import eval_frame
        return eval_frame.set_eval_frame
    except (ImportError, AttributeError):
        return None


SET_EVAL_FRAME = _set_eval_frame()
"""torch.compile's ``set_eval_frame(callback)`` (returns the callback it replaces; None turns
frame evaluation off), or None where torch lacks it. The group's C++ reduction methods
(``backend/csrc/group_method.h``) call it around what they run, as `eager_methods`' wrapper
does."""


def _wrapper_factory() -> Callable[[Callable[..., Any]], Callable[..., Any]] | None:
    try:
        from torch._C._dynamo import eval_frame
        set_eval_frame = SET_EVAL_FRAME
        skip = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP,
                                             eval_frame._FrameAction.DEFAULT)
        set_strategy = eval_frame.set_code_exec_strategy
    except (ImportError, AttributeError, TypeError):
        return None
    if set_eval_frame is None:
        return None

    def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            prior = set_eval_frame(None)
            try:
                return fn(*args, **kwargs)
            finally:
                set_eval_frame(prior)

        set_strategy(run.__code__, skip)
        return run

    return eager


_EAGER = _wrapper_factory()


def eager_methods(cls: T) -> T:
    """Class decorator: every public method and property getter ``cls`` defines itself runs,
    with all it calls, outside torch.compile's frame evaluation (module docstring)."""
    if _EAGER is None:
        return cls
    for name, value in list(vars(cls).items()):
        if name.startswith("_"):
            continue
        if isinstance(value, property) and value.fget is not None:
            setattr(cls, name, property(_EAGER(value.fget), value.fset, value.fdel, value.__doc__))
        elif callable(value) and not isinstance(value, type | staticmethod | classmethod):
            setattr(cls, name, _EAGER(value))
    return cls
