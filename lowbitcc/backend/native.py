"""lowbitcc's C++ Works and steady calls (``backend/csrc/works_module.cpp``), built on first use
and cached (`cpp_build.Extension`, with the C++ codec when the first "loco" group is created).

``FollowedWork``: the Work of a gloo call that the calling thread started itself, a place's
exact entry (`IssueQueue.follow`): waiting and errors are the gloo Work's, and the future c10d's
C++ callers ask for (DDP's reducer) is completed with the call's outputs by a C++ callback on
the thread that completes the gloo Work, without Python. Where the module cannot be built (no
compiler), `load` returns None after one warning and `works.FollowedWork` (Python, completed by
the group's waiter thread) serves instead; ``LOWBITCC_NATIVE_WORKS=0`` forces that path (the
tests run both).

``SteadyRunner`` and ``PlanCore``: the steady calls served in C++ (`steady_runner`,
`plan_cores`); ``AllReduceMethod``, ``ReduceScatterMethod`` and ``ReduceScatterCoalescedMethod``:
a group's reduction methods that hand a call to its runner first (`steady_runner.install`);
``IssueLane``: the thread a group's plan cores run their whole runs on (`issue_queue`). A
plan core calls the C++ codec through its ``codec_api`` capsule (``codec/csrc/codec_api.h``,
whose header this module includes).

``LaunchReplay``: a CUDA place's host record issued from C++ (`launch_record`): the kernels by
the CUDA driver's ``cuLaunchKernel`` (found with ``dlopen``, ``-ldl``), the transfers on the
inner NCCL backend.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

from lowbitcc.codec import cpp_build
from lowbitcc.codec.abi import CSRC as CODEC_CSRC

CSRC = Path(__file__).parent / "csrc"
EXTENSION = cpp_build.Extension(
    "lowbitcc_works", [CSRC / "works_module.cpp"],
    [CSRC / "feedback_slots.h", CSRC / "followed_work.h", CSRC / "group_method.h",
     CSRC / "issue_lane.h", CSRC / "launch_replay.h",
     CSRC / "model_timings.h",
     CSRC / "core_decide.h", CSRC / "core_encode.h", CSRC / "core_issue.h",
     CSRC / "core_run.h", CSRC / "core_spec.h",
     CSRC / "direct_run.h", CSRC / "hier_run.h", CSRC / "plan_core.h", CSRC / "plan_pieces.h",
     CSRC / "planned_work.h", CSRC / "point_completer.h",
     CSRC / "python_objects.h", CSRC / "retired_works.h", CSRC / "ring_run.h",
     CSRC / "runner_count.h",
     CSRC / "runner_device.h", CSRC / "runner_moves.h", CSRC / "runner_place.h",
     CSRC / "runner_planned.h", CSRC / "served_counts.h",
     CSRC / "steady_runner.h",
     CSRC / "tree_run.h",
     CODEC_CSRC / "codec_api.h", CODEC_CSRC / "loco_codec.cuh"], [CSRC, CODEC_CSRC], ["-O2"], ["-ldl"],
    what="lowbitcc's C++ Works",
    fallback="steady calls run through Python and complete through the group's waiter thread "
    "instead")


def load() -> ModuleType | None:
    """The compiled module, or None (no compiler, or ``LOWBITCC_NATIVE_WORKS=0``)."""
    if os.environ.get("LOWBITCC_NATIVE_WORKS", "1") == "0":
        return None
    return EXTENSION.load()


def start() -> None:
    """Begin `load` on a thread of its own (`cpp_build.Extension.start`; not where
    ``LOWBITCC_NATIVE_WORKS=0``): a "loco" group's creation calls it once the ranks agreed on
    the group's settings, before the group's C++ codec build, so that a first build of the
    Works compiles while the codec's does (two builds of one and three translation units share
    the cores instead of taking turns)."""
    if os.environ.get("LOWBITCC_NATIVE_WORKS", "1") != "0":
        EXTENSION.start()
