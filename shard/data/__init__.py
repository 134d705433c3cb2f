"""Training data: built-in tasks, token files, tokenizers."""

from soapstone.comm import moved

# the names `soapstone.shard.data` (a module before 0.2) had: the tasks, make_task, DataError
__getattr__ = moved.names_from(__name__, "tasks", "source", "errors")
