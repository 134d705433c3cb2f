"""The loss: cross_entropy's record and its chunked autograd kernels."""
