"""`p2psync plan`: the real plan at cluster scale from per-rank shapes, with predicted update times.

Modules: presets (public architecture numbers), shapes (analytic per-rank shapes by
sglang's sharding rules), engine (the same from sglang's own model on meta),
cluster (parallelism, nodes, NICs), predict (the real `core.plan.build_plan` per
pipeline stage, loads, link model), report (text, JSON, PNG), miles (the miles
table's setups), command (the CLI).
"""
