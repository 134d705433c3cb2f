"""soapstone.shard.plan: the compiled plan as pure data (no torch).

Layouts, the Program and the StageGraph, pipeline schedules, gradient-bucket planning, the
cost tables of the collectives, explain's estimates and the text `soapstone show` prints.
The compiler (soapstone.dsl) produces these; the runtime (soapstone.shard) executes them.
Nothing here imports torch: `soapstone check/show/explain` run where torch cannot load.
"""

from soapstone.comm import moved

# modules that moved rooms (0.2): their old paths work until 0.3, with a DeprecationWarning
__getattr__ = moved.keep_old_paths("soapstone.shard", {
    "plan.activations": "plan.analysis.activations",
    "plan.buckets": "parallel.bucket_plan",
    "plan.checkpoint_size": "plan.analysis.checkpoint_size",
    "plan.cost": "plan.analysis.cost",
    "plan.dispatch": "parallel.dispatch_plan",
    "plan.explain": "plan.analysis.explain",
    "plan.fit": "plan.analysis.fit",
    "plan.fusions": "runtime.fusion_plan",
    "plan.hardware": "plan.analysis.hardware",
    "plan.offload": "parallel.offload_plan",
    "plan.p2p_proof": "plan.verify.p2p_proof",
    "plan.selective": "parallel.selective_plan",
    "plan.sequence": "plan.verify.sequence",
})
