"""The tools' one matplotlib loader (plots are optional: ``pip install 'lowbitcc[plot]'``)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("lowbitcc.tools")


def pyplot(purpose: str, required: bool = False) -> Any:
    """``matplotlib.pyplot`` on the Agg backend. Without matplotlib: a RuntimeError naming
    ``purpose`` when ``required`` (the user asked for the plot), else a warning and None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if required:
            raise RuntimeError(f"lowbitcc: {purpose} needs matplotlib: "
                               "pip install 'lowbitcc[plot]'") from None
        log.warning("matplotlib is not installed (pip install 'lowbitcc[plot]'); no %s written",
                    purpose)
        return None
    return plt
