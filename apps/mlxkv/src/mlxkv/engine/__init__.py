"""Wiring: the engine the server drives, and the services it is built from."""
