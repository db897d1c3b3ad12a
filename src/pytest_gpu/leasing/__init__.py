"""What a test asks for and how a run grants it: requests, placement (pure), the host's CPUs
and RAM, ports, the broker, its protocol and its client, and the leases a report carries."""
