"""The framework-free core: types, protocols, plan, buffers, writer, session."""
