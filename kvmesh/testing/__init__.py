"""Test and benchmark harnesses that start real services (``mesh``: a whole local mesh)."""
