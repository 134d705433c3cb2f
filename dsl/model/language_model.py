"""What makes a model a next-token language model, and the same model with its logits as an
output (what `generate` samples from).

A language model's loss is `cross_entropy(logits, targets)` where `targets` is an integer input
with the same dims as another integer input, the token ids (`[batch, seq]`), and the logits
are `[batch, seq, vocab]`. Anything else (a classifier, a regression) is not one: BadInput.
"""

from __future__ import annotations

import attrs

from soapstone.dsl.lang.errors import BadInput
from soapstone.dsl.model import ir


@attrs.frozen
class LanguageModel:
    """A model with its logits exposed as output `logits_output`."""

    model: ir.Model
    ids: str  # the token-id input
    targets: str  # the next-token targets input
    logits: str  # the value the loss takes its logits from
    vocab: int
    seq: int
    classes: int = 0  # the real ids (a padded vocab's first ones); 0: all of vocab

    @property
    def real(self) -> int:
        """The ids generation may pick: the logits' size less its padding."""
        return self.classes or self.vocab

    @property
    def logits_output(self) -> str:
        """The name of the added output."""
        return "generate.logits"


def language_model(model: ir.Model, spec: str = "SPEC") -> LanguageModel:
    """`model` with its logits as an extra output; BadInput if it is no language model."""
    loss = next((o for o in model.outputs if o.is_loss), None)
    op = next((o for o in model.ops if loss is not None and o.out == loss.value), None)
    why = None
    if op is None or op.kind != "cross_entropy":
        why = "its loss is not a cross_entropy"
    else:
        logits, targets = op.args[0], op.args[1]
        inputs = {i.name: i for i in model.inputs}
        tgt = inputs.get(targets)
        ids = [i for i in model.inputs if tgt is not None and i.name != targets
               and i.type.dims == tgt.type.dims and i.type.dtype.startswith(("i", "u"))]
        if tgt is None or not ids or len(tgt.type.dims) < 2:
            why = (f"its targets ({targets}) are not next-token targets of the same [batch, "
                   "seq] shape as a token-id input")
    if why:
        raise BadInput(f"{spec}: model '{model.name}' is not a language model ({why}); "
                       "generate samples from a model that reads token ids and predicts the "
                       "next token, like examples/gpt.par")
    value = next(o for o in model.ops if o.out == logits)
    out = ir.Output("generate.logits", logits, False)
    return LanguageModel(attrs.evolve(model, outputs=(*model.outputs, out)), ids[0].name,
                         targets, logits, model.size(value.type.dims[-1]),
                         model.size(ids[0].type.dims[-1]), int(op.attr("classes") or 0))
