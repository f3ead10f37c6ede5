"""The torch backend "loco": registration, the c10d process group and what it delegates to.

`registration` (the name, torch's hooks), `agreement` (the ranks' settings, compared when a
group is created), `process_group` (the c10d face), `issue_queue` (CPU issue order, Works),
`cuda_issue` (CUDA calls: streams and Works, in the calling thread), `exact` (exact reductions
on gloo), `leases` (which calls the cost model leased to the exact path, decided in issue
order), `compressed_call` (compressed calls up to the schedule), `rendezvous` (ranks and address
from torchrun, mpiexec, srun).
"""

BACKEND_NAME = "loco"
"""The name users pass to ``init_process_group``; defined here once."""
