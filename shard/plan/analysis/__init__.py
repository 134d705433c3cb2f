"""Estimates before launch: memory, time, cost and fit on a hardware profile (no torch)."""
