"""vLLM engines as p2psync targets: layouts that reproduce vLLM's own per-rank load
bit for bit, the engine-side endpoint, and a vLLM weight-transfer backend.

Importing this package does not import vLLM; the modules that need it import it lazily.
"""
