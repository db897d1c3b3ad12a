"""How pytest-gpu's processes talk: JSON frames and the Unix sockets they travel on, and the
authenticated service that carries the broker's messages."""
