"""The collectives benchmark behind `soapstone bench comm`, and the timing harness (harness.py)
of the side-by-side benchmarks and `soapstone gpu-check`."""

from soapstone.comm import moved

# the benchmark's names, as `soapstone.comm.bench` (a module before 0.2) had them
__getattr__ = moved.names_from(__name__, "collectives")
