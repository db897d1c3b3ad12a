"""Real GPUs: what the machine has (``devices``), the process's CUDA (``runtime``), applying a
lease (``isolation``) and checking it afterwards (``verification``)."""
