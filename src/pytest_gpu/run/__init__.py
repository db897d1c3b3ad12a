"""One run in each of its processes: its options, the run's state (session), one test's life
(lifecycle) and the requests a suite's conventions give it, leases held by fixtures, the run
directory and the artifacts shared through it, and what earlier runs measured (history)."""
