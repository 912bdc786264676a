"""NIXL transport over its UCX backend (`pip install p2psync[nixl]`)."""
