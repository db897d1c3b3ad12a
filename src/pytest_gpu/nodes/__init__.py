"""One run over several nodes (``--gpu-nodes``): a node host per node, xdist workers on each.

See docs-incoming/nodes-design.md: :mod:`.spec` reads the option and makes the workers'
execnet specs, :mod:`.hosts` starts every node's host (:mod:`.agent`, that node's
inventory, broker and arbiter link) from the controller, :mod:`.worker` is a worker's
side, :mod:`.sshgate` starts a process on a host through ssh.
"""
