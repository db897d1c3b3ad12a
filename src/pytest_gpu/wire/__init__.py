"""How pytest-gpu's processes talk: one wire for the broker, the arbiter and the rank pools.

One framing (:mod:`.frames`: a 4-byte length, bounded JSON), one server loop with
pluggable authentication (:mod:`.server`), one client (:mod:`.client`), one schema per
message checked on arrival both ways (:mod:`.schema`; each protocol declares its own next
to its code), sockets reachable whatever the length of their path (:mod:`.sockets`)."""
