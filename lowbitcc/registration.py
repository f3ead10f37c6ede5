"""Registration of the "loco" backend name with ``torch.distributed``."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

log = logging.getLogger("lowbitcc")

BACKEND_NAME = "loco"


def create_process_group(common_opts: Any, backend_options: Any) -> dist.ProcessGroup:
    """c10d's creator hook (extended API): one `LocoProcessGroup` per group, subgroups too."""
    from lowbitcc.config import LocoConfig
    from lowbitcc.process_group import LocoProcessGroup

    if backend_options is None:
        config = LocoConfig.from_env()
    elif isinstance(backend_options, LocoConfig):
        config = backend_options
    else:
        raise TypeError(
            "lowbitcc: pg_options of a 'loco' group must be a lowbitcc.LocoConfig, got "
            f"{type(backend_options).__name__}"
        )
    return LocoProcessGroup(
        common_opts.store, common_opts.group_rank, common_opts.group_size, common_opts.timeout,
        config, list(common_opts.global_ranks_in_group) or None,
    )


def register_backend() -> None:
    """Make ``"loco"`` a ``torch.distributed`` backend name (idempotent)."""
    from _lowbitcc_autoload import install_rendezvous_hook

    install_rendezvous_hook()
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True, devices=["cpu"])
