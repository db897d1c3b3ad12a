"""Which worker runs which test when: the plan (pure), xdist's scheduler, the catalog of
requests, dependencies between tests, ``-n auto``."""
