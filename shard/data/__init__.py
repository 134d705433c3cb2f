"""Training data: built-in tasks, token files, tokenizers."""

from soapstone.comm import moved

# the tasks' names, as `soapstone.shard.data` (a module before 0.2) had them
__getattr__ = moved.names_from(__name__, "tasks")
