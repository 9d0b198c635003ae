"""Transports: the interface in `_base`, a toolkit for writing one in `_kit`, one module per transport, names in `_registry`."""
