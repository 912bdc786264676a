"""The sending side: what runs on every trainer rank.

`Session` is the facade a trainer calls (`connect`, `update`, `close`); the rest is its
machinery: compiling a connection (plan, buckets, gather-free packings), transfer buffers
and per-engine write threads, delta sending and its baselines, the engines' update lease
and control calls, the trainer world's liveness and collectives.
"""
