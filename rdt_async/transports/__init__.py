"""Transports: the interface in `_base`, one module per transport, names in `_registry`."""
