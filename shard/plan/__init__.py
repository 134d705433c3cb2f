"""soapstone.shard.plan: the compiled plan as pure data (no torch).

Layouts, the Program and the StageGraph, pipeline schedules, gradient-bucket planning, the
cost tables of the collectives, explain's estimates and the text `soapstone show` prints.
The compiler (soapstone.dsl) produces these; the runtime (soapstone.shard) executes them.
Nothing here imports torch: `soapstone check/show/explain` run where torch cannot load.
"""
