"""The C parts of soapstone.comm (comm/observe/); everything else is in pyproject.toml.

- `_flight_ring` (comm/observe/flight_ring.c): the flight recorder's rings. Every comm call
  writes one entry, so they are C; a Python recorder cost 9-14% of an 8-byte allreduce
  (BENCHMARKS.md).
- `_tensor_reader` (comm/observe/tensor_reader.cpp): reads a tensor's shape for the rings from
  torch's C++ tensor, ~5 ns against ~95 ns through torch's Python getters. It compiles against the
  installed torch's headers, so it is built only when torch is importable here: `make install`
  builds without isolation in the venv that holds torch; an isolated build (plain
  `pip install .`), or one without a C++ compiler, leaves it out and the rings read shapes
  through the getters.
"""

import sys

from setuptools import Extension, setup

extensions = [Extension("soapstone.comm.observe._flight_ring", ["comm/observe/flight_ring.c"],
                        depends=["comm/observe/tensor_reader.h"], extra_compile_args=["-O2"])]
try:
    from torch.utils.cpp_extension import CppExtension
except ImportError:
    print("soapstone: torch is not importable while building, so the flight recorder reads "
          "tensor shapes through torch's Python getters (comm/observe/tensor_reader.cpp not built)",
          file=sys.stderr)
else:
    # optional: without a C++ compiler the install goes on and the rings use the getters
    # (the test suite checks that `make install` did build it)
    extensions.append(CppExtension("soapstone.comm.observe._tensor_reader",
    ["comm/observe/tensor_reader.cpp"],
                                   depends=["comm/observe/tensor_reader.h"],
                                   extra_compile_args=["-O2", "-w"], optional=True))

setup(ext_modules=extensions)
