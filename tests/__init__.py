"""p2psync's tests (a package: helpers are imported as `tests.helpers.<module>`)."""
