"""scheduler: which sequences run together, and when a waiting request may start."""
