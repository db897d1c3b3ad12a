"""Machine-wide leasing: every pytest-gpu run of a machine shares one view of its GPUs.

- :mod:`.placement`: which GPUs a request gets, and in which order waiting requests go (pure);
- :mod:`.ports`: TCP ports unique across every run of the machine;
- :mod:`.domain`: where the runs of a machine (or of one simulated machine) meet, and who may;
- :mod:`.arbiter`: the one allocator that decides for all of them (GPUs, host resources, ports);
- :mod:`.messages`: every field of a run's requests, checked (pure);
- :mod:`.server`: the arbiter's socket, served by the run that won the election;
- :mod:`.remote`: a run's connection to the arbiter in another process;
- :mod:`.mirror`: what a run holds and waits for, brought to a new arbiter;
- :mod:`.link`: a run's side: lead or attach, fall back from a squatter, take over on failover.

Everything another local user can reach is checked: see docs/sharing.md, "Sharing a machine"
for the threat model.
"""
