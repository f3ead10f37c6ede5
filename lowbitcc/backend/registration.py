"""The "loco" backend name and its one registration with ``torch.distributed``.

`register` is called by ``import lowbitcc`` and, through the ``torch.backends`` entry point
(``_lowbitcc_autoload.register``), by ``import torch``; it is idempotent. It registers the name
and wraps torch's ``env://`` rendezvous so that mpiexec and srun start ranks like torchrun does
(`lowbitcc.backend.rendezvous`). Nothing else in torch changes until the first "loco" group is
created: `create_process_group` then installs the optimizer-step hook that feedback keys count
steps with (`lowbitcc.state`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.distributed as dist

from lowbitcc.backend import BACKEND_NAME

DEVICES = ["cpu", "cuda"]
"""Device types the backend is registered for: one group serves both."""


def _check_not_mixed() -> None:
    """Refuse a backend string that gives "loco" only some devices ("cpu:gloo,cuda:loco").

    c10d creates a group's backends device by device, but a Python process group such as
    ``LocoProcessGroup`` replaces the whole group (distributed_c10d ``_new_process_group_helper``:
    "the old behavior for PythonProcessGroups which overwrites the ProcessGroup instance"), so
    the other backend would be dropped without a word. The creator cannot see the string; it
    reads c10d's ``backend_config`` from the calling frame when it is there.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None and frame.f_code.co_name != "_new_process_group_helper":
            frame = frame.f_back
        config = frame.f_locals.get("backend_config") if frame is not None else None
    finally:
        del frame
    if config is None or not hasattr(config, "get_device_backend_map"):
        return
    backends = config.get_device_backend_map()
    others = {device: name for device, name in backends.items() if name != BACKEND_NAME}
    if others:
        spec = ",".join(f"{device}:{name}" for device, name in backends.items())
        raise ValueError(
            f"lowbitcc: backend {spec!r} mixes 'loco' with {', '.join(sorted(set(others.values())))}"
            ": a 'loco' group serves every device itself (CPU tensors over gloo, CUDA tensors "
            "over NCCL, inside the group); pass backend='loco'")


def create_process_group(common_opts: Any, backend_options: Any) -> dist.ProcessGroup:
    """c10d's creator hook (extended API): one `LocoProcessGroup` per group, subgroups too.

    ``backend_options`` is the ``pg_options`` of ``init_process_group``/``new_group``: a
    `LocoConfig`, or None for the one read from ``LOCO_*`` variables. Every rank checks that
    all share the settings (`agreement`) before the group is built.
    """
    from lowbitcc import state
    from lowbitcc.backend import agreement, native
    from lowbitcc.backend.process_group import LocoProcessGroup
    from lowbitcc.config import LocoConfig

    _check_not_mixed()
    config: LocoConfig | None = None
    error: Exception | None = None
    try:
        if backend_options is None:
            config = LocoConfig.from_env()
        elif isinstance(backend_options, LocoConfig):
            config = backend_options
        else:
            raise TypeError(
                "lowbitcc: pg_options of a 'loco' group must be a lowbitcc.LocoConfig, got "
                f"{type(backend_options).__name__}"
            )
    except (ValueError, TypeError) as exc:
        error = exc
    config = agreement.agree(common_opts.store, common_opts.group_rank, common_opts.group_size,
                             common_opts.timeout, config, error)
    native.start()  # (a first build of the C++ Works, beside the group's codec build)
    state.install_step_hook()
    state.bound_feedback(config.max_keys)
    return LocoProcessGroup(
        common_opts.store, common_opts.group_rank, common_opts.group_size, common_opts.timeout,
        config, list(common_opts.global_ranks_in_group) or None, group_id=common_opts.group_id,
    )


def register() -> None:
    """Make ``"loco"`` a ``torch.distributed`` backend name (idempotent)."""
    from lowbitcc.backend.rendezvous import install_env_hook

    install_env_hook()
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                      devices=DEVICES)
