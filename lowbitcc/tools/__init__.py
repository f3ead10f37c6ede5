"""Everything the ``lowbitcc`` command runs: demo, perf, codec-bench, study, netem, and the one
local-rank spawner they share (`spawn`). The library never imports this package."""
