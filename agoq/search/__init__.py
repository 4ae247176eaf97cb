"""agoq's search: cost models from a Profile and the per-layer bit-width optimisation (planned)."""
