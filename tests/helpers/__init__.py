"""Helpers the tests share: processes, tiny models, engine rank loads."""
