"""A process and its GPUs: which GPUs the run uses (``discovery``), the process's runtime
(``runtime``), applying a lease (``isolation``, ``adapters``, ``confine``) and checking it afterwards
(``verification``, ``calibration``, ``foreign``)."""
