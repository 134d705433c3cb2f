"""The registry of primitive ops: every record by name, what every consumer reads.

The compiler (dsl/compile/rules.py), the IR's list of primitives, the runtime's kernels
(dispatch.run_op), the plan's estimates (activations, cost, selective recompute, explain), the
verifier (plan/verify/sequence.py) and fusion (runtime/fusion_plan.py) look an op up here and
read its record; none keeps a table of its own. A new primitive is one record in a module of
this room (or its loss/ and positions/), listed in FAMILIES.
"""

from __future__ import annotations

from soapstone.shard.ops import dims, einsum, elementwise, embedding, moe, norms, softmax
from soapstone.shard.ops.custom import CUSTOM, PREFIX
from soapstone.shard.ops.loss import cross_entropy
from soapstone.shard.ops.positions import masks, rope
from soapstone.shard.ops.record import OpRecord

FAMILIES = (einsum, embedding, elementwise, norms, softmax, masks, dims, rope, cross_entropy,
            moe)

RECORDS: dict[str, OpRecord] = {r.name: r for family in FAMILIES for r in family.RECORDS}


def record_of(kind: str) -> OpRecord:
    """The record of primitive `kind` (every "custom:<name>" shares one)."""
    found = RECORDS.get(kind)
    if found is not None:
        return found
    if kind.startswith(PREFIX):
        return CUSTOM
    raise KeyError(f"no primitive op {kind!r}: its record belongs in a module of shard/ops/, "
                   "listed in shard/ops/registry.py")


def docs() -> dict[str, str]:
    """Each primitive's args and attrs, by name (what `ir.PRIMITIVES` lists)."""
    return {name: r.doc for name, r in RECORDS.items()}
