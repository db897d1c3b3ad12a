"""An authenticated Unix-socket service (the transport of a run's lease service).

- :mod:`.authserver`: the listener, the handshakes and one serving thread;
- :mod:`.handshake`: ``multiprocessing.connection``'s key challenge and answer, a frame at a time.
"""
