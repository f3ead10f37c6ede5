"""Registers the "loco" backend while ``import torch`` runs (entry point ``torch.backends``).

Torch calls `register` at the end of its own import. It must never raise (a failure would break
every ``import torch``), so any error is logged and ``import lowbitcc`` is left to register the
name. The registration itself is `lowbitcc.backend.registration.register`, the only one.
"""

import logging


def register() -> None:
    try:
        from lowbitcc.backend.registration import register as register_loco

        register_loco()
    except Exception as exc:  # noqa: BLE001 (see the module docstring)
        logging.getLogger("lowbitcc").warning(
            "lowbitcc: could not register the 'loco' backend at torch import (%s); "
            "`import lowbitcc` registers it", exc,
        )
