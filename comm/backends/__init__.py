"""Communicator backends: MPI (CPU) and NCCL (GPU)."""
