"""Strategies over the runtime: data parallel and ZeRO, expert dispatch, offload, recompute."""
