"""Ray clusters for tests: the session-scoped ``ray_cluster`` fixture.

``ray_cluster`` connects this test process to a Ray cluster and disconnects it when the
session ends. With ``--ray-address`` it joins that cluster and never stops it; without,
it starts a local head with the run's resources: one Ray GPU per GPU of the run
(simulated ones included, so ``--gpus sim:4x16GiB`` gives ``num_gpus=4`` and Ray sets
``CUDA_VISIBLE_DEVICES`` to one index in a task that asks for one GPU) and one Ray CPU
per CPU this process may run on. One head serves the whole run, xdist workers included;
the process that owns the run directory stops it (:class:`RayHead`, the feature's hook
object there), and its watchdog stops it if the run dies.

Each module builds on those before it: head (what a head is), readiness (this process's
driver), stop, watchdog, startonce (one head per run), driver (the fixture).
"""

from .driver import connect, fixture
from .head import RayCluster, RayClusterError
from .stop import RayHead, stop_head

__all__ = ["RayCluster", "RayClusterError", "RayHead", "connect", "fixture", "stop_head"]
