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


def install_rendezvous_hook() -> None:
    """Wrap torch's ``env://`` rendezvous so that it first fills torchrun's variables from
    mpiexec's or srun's (`lowbitcc.launcher`, imported when a group is initialised)."""
    import sys

    handlers = getattr(sys.modules.get("torch.distributed.rendezvous"), "_rendezvous_handlers", None)
    if not isinstance(handlers, dict) or getattr(handlers.get("env"), "_lowbitcc", False):
        return
    original = handlers["env"]

    def env_rendezvous(url, *args, **kwargs):
        from lowbitcc.launcher import export_for_url

        export_for_url(url)
        return original(url, *args, **kwargs)

    env_rendezvous._lowbitcc = True
    handlers["env"] = env_rendezvous


def register() -> None:
    try:
        import torch.distributed as dist

        if "loco" not in dist.Backend.backend_list:
            dist.Backend.register_backend("loco", _create, extended_api=True, devices=["cpu"])
        install_rendezvous_hook()
    except Exception as exc:  # noqa: BLE001
        logging.getLogger("lowbitcc").warning(
            "lowbitcc: could not register the 'loco' backend at torch import (%s); "
            "`import lowbitcc` registers it", exc,
        )
