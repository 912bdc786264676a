"""Integrations with RL frameworks: verl's checkpoint-engine backend, miles' and slime's weight updaters.

Each module imports its framework lazily or not at all, so `import p2psync` stays light.
"""
