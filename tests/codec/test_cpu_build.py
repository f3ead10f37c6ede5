"""How a process finds the C++ codec's build (`cpu.load`): imported directly where it is built
and unlocked, through torch's ``cpp_extension`` (which builds, and waits for another process's
build) elsewhere."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch.utils.cpp_extension

from lowbitcc.backend import native
from lowbitcc.codec import cpp_build, cpu


def test_where_a_compiler_is_found_both_cpp_modules_build():
    """Where the machine has the compiler torch builds with (``CXX``, else ``c++``), the C++
    codec and the C++ Works must build: the tests that need them skip without them (a compile
    error in one header skipped some hundred), so a build that fails fails here, with the
    warning that names its error."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) here: the Python paths run instead")
    assert cpu.load() is not None, "the C++ codec did not build here (its warning says why)"
    if os.environ.get("LOWBITCC_NATIVE_WORKS", "1") != "0":
        assert native.load() is not None, "lowbitcc's C++ Works did not build here (its warning says why)"


def test_a_made_build_is_imported_without_cpp_extension():
    """A fresh process loads the build the suite made without importing ``cpp_extension`` or
    setuptools (about 0.4 s of every rank's first group before)."""
    if cpu.load() is None:
        pytest.skip("the C++ codec cannot be built here")
    done = subprocess.run([sys.executable, "-c", (
        "import sys; from lowbitcc.codec import cpu; assert cpu.load() is not None; "
        "print(sorted(m for m in ('torch.utils.cpp_extension', 'setuptools') if m in sys.modules))")],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def _torch_load(monkeypatch) -> list[dict]:
    calls: list[dict] = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load",
                        lambda **kwargs: calls.append(kwargs) or "torch's module")
    return calls


@pytest.mark.parametrize("case", ["locked", "unimportable", "missing"])
def test_a_build_being_made_unimportable_or_missing_goes_through_torch(case, tmp_path, monkeypatch):
    """A lock file of torch's (a build under way), a build that does not import, or none: the
    module comes from ``cpp_extension.load`` into the same folder."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = cpu.EXTENSION.name()
    directory = cpp_build.build_directory(name)
    assert directory == tmp_path / "lowbitcc" / name
    if case != "missing":
        directory.mkdir(parents=True)
        (directory / f"{name}.so").write_bytes(b"not a module")
    if case == "locked":
        (directory / "lock").touch()
    imported: list[str] = []
    real_import = cpp_build._import
    monkeypatch.setattr(cpp_build, "_import", lambda n, p: imported.append(n) or real_import(n, p))
    calls = _torch_load(monkeypatch)
    with pytest.warns(RuntimeWarning, match="building") if case == "missing" else contextlib.nullcontext():
        assert cpu.EXTENSION._load() == "torch's module"
    assert [c["build_directory"] for c in calls] == [str(directory)]
    assert imported == ([name] if case == "unimportable" else [])


def test_a_started_build_and_a_load_meanwhile_make_one_module(monkeypatch):
    """`Extension.start` builds on a thread of its own (once, returning at once); a `load`
    that comes meanwhile waits for that build and gets its module: one build, one module."""
    extension = cpp_build.Extension("lowbitcc_test", [], [], [], [], [], what="a test module",
                                    fallback="nothing")
    made, entered, release = [], threading.Event(), threading.Event()

    def slow_build():
        entered.set()
        assert release.wait(30)
        made.append(threading.current_thread().name)
        return made[-1]

    monkeypatch.setattr(extension, "_load", slow_build)
    extension.start()
    assert entered.wait(30)  # the build runs on the started thread ...
    began = time.monotonic()
    extension.start()
    assert time.monotonic() - began < 1  # ... and a second start returns at once
    got: list[object] = []
    waiting = threading.Thread(target=lambda: got.append(extension.load()))
    waiting.start()
    time.sleep(0.3)
    assert got == []  # the build under way is waited for
    release.set()
    waiting.join(30)
    assert made == ["lowbitcc build of lowbitcc_test"] and got == made
    assert extension.load() == made[0]


def test_a_child_forked_while_a_build_is_under_way_loads_anew():
    """A fork while `start`'s thread holds the extension's lock (mid-build) leaves the child a
    lock of its own: its `load` builds or imports for itself instead of waiting forever."""
    import signal

    extension = cpp_build.Extension("lowbitcc_test", [], [], [], [], [], what="a test module",
                                    fallback="nothing")
    entered, release = threading.Event(), threading.Event()

    def parent_build():
        entered.set()
        return "parent's" if release.wait(30) else None

    extension._load = parent_build
    extension.start()
    assert entered.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: its own `_load`, not waiting on the parent's thread
        extension._load = lambda: "child's"
        os._exit(0 if extension.load() == "child's" else 1)
    deadline, status = time.monotonic() + 30, None
    while status is None and time.monotonic() < deadline:
        done, code = os.waitpid(pid, os.WNOHANG)
        status = code if done else None
        time.sleep(0.05)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    release.set()
    assert status is not None, "the forked child's load waited on the parent's build"
    assert os.waitstatus_to_exitcode(status) == 0
    assert extension.load() == "parent's"


def test_a_loco_group_starts_the_works_build_once_its_settings_are_agreed(tmp_path):
    """`create_process_group` starts the Works' build (`native.start`) after the ranks agreed
    on the settings: not for a group whose settings are refused (its process then exits at
    once, not after a build), and for one that is made."""
    code = f"""
import os, torch.distributed as dist, lowbitcc
from lowbitcc.backend import native
started = []
native.EXTENSION.start = lambda: started.append(True)
os.environ["LOCO_BITS"] = "99"
try:
    dist.init_process_group("loco", init_method="file://{tmp_path}/a", rank=0, world_size=1)
except ValueError as exc:
    print("refused", len(started), "LOCO_BITS" in str(exc) or "bits" in str(exc))
del os.environ["LOCO_BITS"]
dist.init_process_group("loco", init_method="file://{tmp_path}/b", rank=0, world_size=1)
print("made", len(started))
dist.destroy_process_group()
"""
    # the Works on, whatever the suite runs under (`start` is replaced: nothing is built)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "LOWBITCC_NATIVE_WORKS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["refused 0 True", "made 1"], done.stdout


def test_the_works_build_is_not_started_where_the_works_are_off(monkeypatch):
    from lowbitcc.backend import native

    started: list[bool] = []
    monkeypatch.setattr(native.EXTENSION, "start", lambda: started.append(True))
    monkeypatch.setenv("LOWBITCC_NATIVE_WORKS", "0")
    native.start()
    assert started == []
    monkeypatch.setenv("LOWBITCC_NATIVE_WORKS", "1")
    native.start()
    assert started == [True]


@pytest.mark.parametrize("minutes", [1, 60])
def test_a_lock_file_a_killed_build_left_is_named_before_torch_waits_for_it(
        minutes, tmp_path, monkeypatch):
    """A lock file of torch's older than `cpp_build.STALE_LOCK_S` (a build killed midway):
    a warning names it before torch's wait, which has no end; a fresh one (a build under way
    in another process) is waited for quietly."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = cpp_build.build_directory(cpu.EXTENSION.name())
    directory.mkdir(parents=True)
    lock = directory / "lock"
    lock.touch()
    then = time.time() - 60 * minutes
    os.utime(lock, (then, then))
    calls = _torch_load(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu.EXTENSION._load() == "torch's module"
    stale = [str(w.message) for w in caught if "lock file" in str(w.message)]
    assert len(calls) == 1
    if minutes > 10:
        assert len(stale) == 1 and str(lock) in stale[0] and "60 minutes old" in stale[0], stale
    else:
        assert stale == []


def test_the_build_name_hashes_every_file_the_sources_include():
    """Every file a source or header of a build (the C++ codec's, the works') includes is one
    the build's name hashes (its `cpp_build.Extension`'s sources and headers): an unlisted
    header would leave an edited header's old build in use. Every CPU source in the codec's
    directory is the codec's (`cpu.SOURCES`, `cpu.HEADERS`)."""
    import re

    from lowbitcc.backend import native

    for extension in (cpu.EXTENSION, native.EXTENSION):
        files = [*extension.sources, *extension.headers]
        hashed = {p.name for p in files}
        for path in files:
            for name in re.findall(r'#include "([^"]+)"', path.read_text()):
                assert name in hashed, (extension.what, path.name, name)
    assert {p.name for p in cpu.CSRC.glob("cpu_*")} <= {
        p.name for p in [*cpu.SOURCES, *cpu.HEADERS]}
