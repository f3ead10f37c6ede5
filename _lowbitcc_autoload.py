"""Registers the "loco" backend while ``import torch`` runs (entry point ``torch.backends``).

This module lives outside the ``lowbitcc`` package on purpose: torch calls it before it has
finished importing itself, so it must import nothing but ``torch.distributed`` and must never
raise (a failure would break every ``import torch``). The process group is imported lazily,
when the first "loco" group is created.
"""

import logging


def _create(common_opts, backend_options):
    from lowbitcc.registration import create_process_group

    return create_process_group(common_opts, backend_options)


def register() -> None:
    try:
        import torch.distributed as dist

        if "loco" not in dist.Backend.backend_list:
            dist.Backend.register_backend("loco", _create, extended_api=True, devices=["cpu"])
    except Exception as exc:  # noqa: BLE001
        logging.getLogger("lowbitcc").warning(
            "lowbitcc: could not register the 'loco' backend at torch import (%s); "
            "`import lowbitcc` registers it", exc,
        )
