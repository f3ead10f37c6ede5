"""What the callbacks lowbitcc runs on gloo's threads let go of, and where it is let go.

A gloo group (torch's ``ProcessGroupGloo``) joins its worker threads when it is destroyed, so it
must never be destroyed on one of them: its destructor would join the thread it runs on and the
process would abort ("terminate called after throwing an instance of 'std::system_error' ...
Resource deadlock avoided"). A callback on a gloo future runs on the gloo thread that completes
the future, and what it holds (an exact call's finishing, a timing's issuer, a plan core) may
reach a gloo group: where the caller has meanwhile destroyed the "loco" group
(``destroy_process_group``, right after waiting for its last call, whose future is complete
before its callbacks have returned), the callback's is the group's last reference.

So each Python callback lowbitcc adds to a gloo future is a `GlooCallback`: once it has run on a
gloo thread, it parks what it held here instead of letting go of it there, and a plan core
destroyed there parks its group's Python object (`park`, csrc/plan_core.h). What is parked is let
go on a thread Python started (`let_go`): at a group's shutdown, and where a `GlooCallback` is made
once many are parked (`let_go_if_many`); what is left goes with this module at the
interpreter's exit, on the main thread. The C++ objects that hold a gloo group and die with the
GIL (the steady runner) let go of it without the GIL, so that its threads, which a Python
callback may keep waiting for the GIL, can be joined.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

LET_GO_AT = 256
"""How many parked objects the making of gloo callbacks lets accumulate before letting go."""

_parked: list[Any] = []  # appended to on gloo's threads, cleared on Python's (both atomic)


class GlooCallback:
    """``fn`` as a callback of a gloo future (``then``, ``add_done_callback``): called once,
    with the future, it returns what ``fn`` returns (or raises what it raises) and then lets go
    of ``fn`` through `park`. Making one lets go of what is parked once there is much
    (`let_go_if_many`)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        let_go_if_many()
        self._fn: Callable[[Any], Any] | None = fn

    def __call__(self, future: Any) -> Any:
        fn, self._fn = self._fn, None
        try:
            return fn(future)  # type: ignore[misc]
        finally:
            park(fn)
            fn = None  # (a traceback of its error keeps this frame, not fn)


def on_python_thread() -> bool:
    """Whether the calling thread is one Python started (a gloo thread is not: `threading`
    names a thread it did not start a dummy)."""
    return not isinstance(threading.current_thread(), threading._DummyThread)


def park(obj: Any) -> None:
    """Let go of ``obj`` (the caller's reference) safely: on a thread Python started the caller
    lets go of it at once; elsewhere (a gloo thread) it is kept until `let_go`."""
    if not on_python_thread():
        _parked.append(obj)


def let_go() -> None:
    """Let go of what is parked, here, where this is a thread Python started (elsewhere
    nothing). A group destroyed by it is destroyed here: its destructor waits for its queued
    calls and joins its threads, without the GIL."""
    if on_python_thread():
        _parked.clear()


def let_go_if_many() -> None:
    """`let_go` once `LET_GO_AT` objects are parked (each `GlooCallback` made calls it, so that
    a long run keeps few)."""
    if len(_parked) >= LET_GO_AT:
        let_go()


def parked() -> int:
    """How many objects are parked (for tests)."""
    return len(_parked)
