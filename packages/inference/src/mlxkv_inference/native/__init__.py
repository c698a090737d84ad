"""native: the CPU kernel bindings and the fused layers and batched step built on them."""
