"""Training: the trainer, optimizers, lr schedules, generation, golden runs."""

from soapstone.comm import moved

# the trainer's names, as `soapstone.shard.train` (a module before 0.2) had them
__getattr__ = moved.names_from(__name__, "trainer")
