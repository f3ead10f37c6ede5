"""How a process finds the C++ codec's build (`cpu.load`): imported directly where it is built
and unlocked, through torch's ``cpp_extension`` (which builds, and waits for another process's
build) elsewhere."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time

import pytest
import torch.utils.cpp_extension

from lowbitcc.codec import cpp_build, cpu


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
    """`Extension.start` builds on a thread of its own (once); a `load` that comes meanwhile
    waits for that build and gets its module: one build, one module, whoever asks first."""
    extension = cpp_build.Extension("lowbitcc_test", [], [], [], [], [], what="a test module",
                                    fallback="nothing")
    made, release = [], threading.Event()

    def slow_build():
        assert release.wait(30)
        made.append(object())
        return made[-1]

    monkeypatch.setattr(extension, "_load", slow_build)
    extension.start()
    time.sleep(0.2)  # (its thread under way, holding the build's lock)
    began = time.monotonic()
    extension.start()
    assert time.monotonic() - began < 1  # returns at once
    got: list[object] = []
    waiting = threading.Thread(target=lambda: got.append(extension.load()))
    waiting.start()
    time.sleep(0.3)
    assert got == []  # the build under way is waited for
    release.set()
    waiting.join(30)
    assert len(made) == 1 and got == made and extension.load() is made[0]


def test_a_child_forked_while_a_build_is_under_way_loads_anew():
    """A fork while `start`'s thread holds the extension's lock (mid-build) leaves the child a
    lock of its own: its `load` builds or imports for itself instead of waiting forever."""
    import os

    extension = cpp_build.Extension("lowbitcc_test", [], [], [], [], [], what="a test module",
                                    fallback="nothing")
    release = threading.Event()
    extension._load = lambda: "parent's" if release.wait(30) else None
    extension.start()
    time.sleep(0.2)
    pid = os.fork()
    if pid == 0:  # the child: its own `_load`, not waiting on the parent's thread
        extension._load = lambda: "child's"
        os._exit(0 if extension.load() == "child's" else 1)
    _, status = os.waitpid(pid, 0)
    release.set()
    assert os.waitstatus_to_exitcode(status) == 0
    assert extension.load() == "parent's"


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
