"""The receiving side: what runs inside an engine worker.

`EngineEndpoint` registers a rank's parameter memory with the transport, publishes its
target table and serves the control routes; `EngineState` is the rank's update state
machine (serving, paused, stale) with its lease; `patch` applies delta patches in place.
Engine adapters build their endpoints from these.
"""
