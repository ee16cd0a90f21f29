"""The built-in token dispatchers: ``allgather`` and ``alltoall``."""
