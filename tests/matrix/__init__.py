"""The conformance suite run against the built-in adapters, the engines and the integrations."""
