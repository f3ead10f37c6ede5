"""The torch backend "loco": registration, the c10d process group and what it delegates to.

`registration` (the name, torch's hooks), `agreement` (the ranks' settings, compared when a group
is created), `process_group` (the c10d face; its reductions), `data_movement` (the exact data
movements), `arguments` (argument checks), `issuer` (how a device's reductions are issued:
`worker_issue` for CPU through the worker thread, `inline_issue` for CPU in the calling thread
under ``LOCO_ISSUER=inline``, `cuda_issue` for CUDA: streams and Works), `issue_queue` (the
worker: CPU issue order), `works` (its Works and futures), `exact` (exact reductions on gloo),
`reductions` (how a reduction is issued: its place, exact entries at once, deviations, jobs),
`call_schedule` (every reduction's place in the cycle of calls, agreed once; `call_entry` what a
call finds there, `call_cycle` how the cycle is learned), `call_plan` (a compressed entry's kept
state and run),
`deviation` (what a rank whose call differs from its place's runs), `call_agreement` (the per-call
descriptor exchange), `routes` (a device's kernels and links), `compressed_call` (one compressed
call and its phases), `compressed_calls` (what a group's compressed calls share), `watchdog` and
`cuda_verdicts` (what CUDA calls leave to read later, and the watch over them), `rendezvous`
(ranks and address from torchrun, mpiexec, srun).
"""

BACKEND_NAME = "loco"
"""The name users pass to ``init_process_group``; defined here once."""
