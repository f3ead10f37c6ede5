"""`Extension`: a C++ extension module of lowbitcc's, built on first use and cached.

Built with torch's ``cpp_extension`` (ninja) into torch's extension cache (`build_directory`),
with a warning while a build runs; every process of an install shares the build (torch
serialises concurrent builds with a lock file, and a process that finds the build made and
unlocked imports it without torch). The cache entry's name hashes everything that changes the
binary: the sources and headers, the flags, where the sources are (torch's own rebuild check
hashes the absolute include path, so two checkouts sharing one entry rebuilt each other's),
torch's version and location, Python's version and the compiler. Where no compiler is
available, `Extension.load` returns None after one warning and the caller takes its Python path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

STALE_LOCK_S = 600.0
"""A lock file of torch's in a build's folder older than this is most likely left by a build
that was killed midway (torch removes it when a build ends, failed or not): `Extension.load`
says so, with the file's path, before torch waits for it to go, which it does without end."""


class Extension:
    """The module ``prefix_<digest>`` built from ``sources`` (which include ``headers``, from
    ``include_dirs``) with ``cflags`` and ``ldflags``; ``what`` names it in warnings and
    ``fallback`` says what runs where it cannot be built. ``load()`` (cached per process) is the
    module or None; ``start()`` begins it on a thread of its own.

    Threads: any. The first `load` builds or imports under the extension's lock; a caller that
    comes meanwhile (a `start`'s thread, or the caller that started it) waits for it and gets
    the same module."""

    def __init__(self, prefix: str, sources: Sequence[Path], headers: Sequence[Path],
                 include_dirs: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str],
                 what: str, fallback: str) -> None:
        self.prefix, self.sources, self.headers = prefix, list(sources), list(headers)
        self.include_dirs, self.cflags, self.ldflags = list(include_dirs), list(cflags), list(ldflags)
        self.what, self.fallback = what, fallback
        self._lock = threading.Lock()  # held by `load` while it builds or imports
        self._loaded: list[ModuleType | None] = []  # `load`'s answer, once given
        self._starting = threading.Lock()  # `start`'s, for `_started`
        self._started = False
        os.register_at_fork(after_in_child=self._forked)

    def load(self) -> ModuleType | None:
        """The compiled module, or None when it cannot be built (see `_load`); made once per
        process, the callers meanwhile waiting for it."""
        with self._lock:
            if not self._loaded:
                self._loaded.append(self._load())
            return self._loaded[0]

    def _forked(self) -> None:
        """In a forked child: a lock a `start`'s thread held at the fork is held by no thread
        of the child's, and the build it made is the parent's to finish: the child's `load`
        begins anew (and finds the parent's build made, or waits on torch's lock file)."""
        self._lock, self._starting = threading.Lock(), threading.Lock()
        if not self._loaded:
            self._started = False

    def start(self) -> None:
        """Begin `load` on a thread of its own (once; not a daemon: a build that began is
        finished before the process exits, so that no half-made build or lock file is left),
        so that a build compiles beside the caller's other work: the first "loco" group builds
        the C++ Works while its codec builds. A later `load` waits for it."""
        with self._starting:  # (not the build's lock, which a build under way holds)
            if self._loaded or self._started:
                return
            self._started = True
        threading.Thread(target=self.load, name=f"lowbitcc build of {self.prefix}").start()

    def name(self) -> str:
        """The module's name: the prefix and the build's digest (see the module docstring)."""
        h = hashlib.sha256()
        for path in [*self.sources, *self.headers]:  # each file's name and length: a move
            data = path.read_bytes()                  # between files shows
            h.update(f"{path.name}\0{len(data)}\0".encode() + data)
        for part in (" ".join(self.cflags), " ".join(self.ldflags),
                     *(str(d.resolve()) for d in self.include_dirs), torch.__version__,
                     os.path.dirname(torch.__file__), sys.version, os.environ.get("CXX", "c++")):
            h.update(part.encode() + b"\0")
        return f"{self.prefix}_{h.hexdigest()[:12]}"

    def _load(self) -> ModuleType | None:
        """The compiled module, or None when it cannot be built. A build that is there and not
        being made (no lock file of torch's) is imported directly: importing ``cpp_extension``
        (setuptools) and its lock took about 0.4 s of every rank's first "loco" group."""
        name = self.name()
        directory = build_directory(name)
        built = directory / f"{name}.so"
        if built.exists() and not (directory / "lock").exists():
            try:
                return _import(name, built)
            except ImportError:  # torch's path decides: ninja rebuilds only where an input
                pass             # changed, else its import fails too and the fallback runs
        try:
            from torch.utils import cpp_extension

            if not built.exists():
                warnings.warn(f"lowbitcc: building {self.what} into {directory} "
                              "(once per install; about a minute)", RuntimeWarning, stacklevel=4)
            lock = directory / "lock"
            try:
                age = time.time() - lock.stat().st_mtime
            except OSError:  # no lock: no build under way
                age = 0.0
            if age > STALE_LOCK_S:
                warnings.warn(f"lowbitcc: {self.what}: torch's lock file {lock} is "
                              f"{age / 60:.0f} minutes old, and torch waits until it is gone: "
                              "if no process is building it (a build killed midway leaves the "
                              "file behind), delete the file", RuntimeWarning, stacklevel=4)
            directory.mkdir(parents=True, exist_ok=True)
            return cpp_extension.load(
                name=name,
                sources=[str(s) for s in self.sources],
                extra_include_paths=[str(d) for d in self.include_dirs],
                extra_cflags=self.cflags,
                extra_ldflags=self.ldflags,
                build_directory=str(directory),
                verbose=os.environ.get("LOWBITCC_BUILD_VERBOSE") == "1",
            )
        except Exception as exc:  # noqa: BLE001 (any build failure means: take the fallback)
            warnings.warn(
                f"lowbitcc: {self.what} could not be built ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}); "
                f"{self.fallback}", RuntimeWarning, stacklevel=4)
            return None


def build_directory(name: str) -> Path:
    """Where the module ``name`` is built: ``lowbitcc/<name>`` under ``TORCH_EXTENSIONS_DIR``,
    else under ``torch_extensions`` in the user's cache folder (``XDG_CACHE_HOME`` or
    ``~/.cache``), as torch's own extensions."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions")
    return Path(root) / "lowbitcc" / name


def _import(name: str, path: Path) -> ModuleType:
    """The extension module ``name`` built at ``path`` (as torch's loader imports it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"lowbitcc: {path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
