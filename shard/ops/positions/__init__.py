"""Ops by global position along a dim: the rotary embedding (rope) and the causal mask."""
