"""What a test asks for and how a run grants it: requests and their conventions, placement
(pure), the host's CPUs and RAM, ports, the broker and its client."""
