"""Transports: each a `Transport` over one library, registered as a plugin."""
