"""`p2psync plan`: the real plan at cluster scale from per-rank shapes, with predicted update times.

Modules: presets (public architecture numbers), shapes (analytic per-rank shapes by
sglang's sharding rules), engine (the same from sglang's own model on meta, through the
sglang adapter's public `rank_params`), cluster (parallelism, nodes, links), predict (the
real `core.plan.build_plan` per pipeline stage, loads, the wire's link model), update (the
whole update: gathers, production, wire, control), plan (all of it for one model and
cluster), setups (published end-to-end figures and their setups), compare (predicted
against published), report (text, JSON, PNG), command (the CLI).
"""
