"""A run's lease service: the broker (in the run's owner), its protocol and its client (in
every test process), and the machine's CPUs and RAM as leases."""
