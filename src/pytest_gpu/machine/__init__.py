"""Machine-wide leasing: every pytest-gpu run of a machine shares one view of its GPUs.

- :mod:`.domain`: where the runs of a machine (or of one simulated machine) meet;
- :mod:`.arbiter`: the one allocator that decides for all of them;
- :mod:`.wire`: JSON frames between runs and the arbiter;
- :mod:`.server`: the arbiter's socket, served by the run that holds the lock;
- :mod:`.link`: a run's side: lead or attach, mirror what it holds, take over on failover.
"""
