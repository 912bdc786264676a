"""Mooncake Transfer Engine transport (`pip install p2psync[mooncake]`)."""
