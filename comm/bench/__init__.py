"""The collectives benchmark behind `soapstone bench comm`."""

from soapstone.comm import moved

# the benchmark's names, as `soapstone.comm.bench` (a module before 0.2) had them
__getattr__ = moved.names_from(__name__, "collectives")
