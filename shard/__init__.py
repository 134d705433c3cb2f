"""soapstone.shard: sharded torch modules and what runs them.

Rooms: ops/ (one record per primitive op), plan/ (the compiled plan as torch-free data:
layouts, Program, stage graph, schedules, analysis/, verify/), runtime/ (the executor and the
sharded model), parallel/ (data parallel and ZeRO, expert dispatch, offload, recompute),
train/ (trainer, optimizers, generation, golden runs), data/ (tasks, token files, tokenizers),
checkpoint/ (safetensors shards and their index).
"""

from soapstone.comm import moved

# modules that moved rooms (0.2): their old paths work until 0.3, with a DeprecationWarning
__getattr__ = moved.keep_old_paths(__name__, {
    "calibrate": "runtime.calibrate",
    "counter_rng": "runtime.init.counter_rng",
    "data_error": "data.errors",
    "data_parallel": "parallel.data_parallel",
    "executor": "runtime.executor",
    "fusion": "runtime.fusion",
    "generate": "train.generate",
    "golden": "train.golden",
    "lr_schedule": "train.lr_schedule",
    "memory": "runtime.memory",
    "moe": "ops.moe",
    "moe_dispatch": "parallel.moe_dispatch",
    "offload": "parallel.offload",
    "optim": "train.optim",
    "param_init": "runtime.init.param_init",
    "recompute": "parallel.recompute",
    "selective": "parallel.selective",
    "split_backward": "runtime.split_backward",
    "token_memmap": "data.token_memmap",
    "tokenizer": "data.tokenizer",
    "trace": "runtime.trace",
    "zero": "parallel.zero",
})
