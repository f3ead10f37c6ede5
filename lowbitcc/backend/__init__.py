"""The torch backend "loco": registration, the c10d process group and what it delegates to.

`registration` (the name, torch's hooks), `process_group` (the c10d face), `issue_queue` (issue
order, Works), `exact` (exact reductions on gloo), `compressed_call` (compressed calls up to the
schedule), `rendezvous` (ranks and address from torchrun, mpiexec, srun).
"""

BACKEND_NAME = "loco"
"""The name users pass to ``init_process_group``; defined here once."""
