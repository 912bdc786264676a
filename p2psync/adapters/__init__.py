"""Adapters: trainer sources and engine targets, each registered as a plugin."""
