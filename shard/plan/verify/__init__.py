"""Proofs before launch: every rank's collectives and p2p pair up and finish (no torch)."""

from soapstone.comm import moved

# the verifier's names, as `soapstone.shard.plan.verify` (a module before 0.2) had them
__getattr__ = moved.names_from(__name__, "prove")
