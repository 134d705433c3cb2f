"""Which config.json field each spec option stands for, and the located error when a spec
disagrees with the config: FILE:LINE:COL of the spec's op or layer, the field, both values and
the argument to write (`mismatch_of_op`, `mismatch_of_param`).

A model is compared with the one its config describes (hf.spec_text) op by op; an op whose
attrs differ names the attr, and this table says which field of config.json set it and which
argument of the spec's layer holds it. A model that differs in another way gets the generic
message at the op's place.
"""

from __future__ import annotations

import attrs

from soapstone.dsl.interop.hf_config import HFConfig, HFError
from soapstone.dsl.lang.errors import Diagnostic
from soapstone.dsl.model import ir


class HFMismatch(HFError):
    """A spec that computes something else than the config says, at the spec's place."""

    def __init__(self, message: str, hint: str | None, loc: ir.Loc | None):
        super().__init__(message, hint)
        self.loc = loc

    def format(self) -> str:
        """Compiler-style: FILE:LINE:COL, the source line with a caret, the hint."""
        if self.loc is None:
            return super().format()
        try:
            with open(self.loc.file) as f:
                source = f.read().splitlines()[self.loc.line - 1]
        except (OSError, IndexError):
            source = None
        return Diagnostic(self.loc.file, self.loc.line, self.loc.col, str(self), self.hint,
                          source, self.loc.end_col).format()


@attrs.frozen
class Field:
    """The config field behind an op attr: its name per family, and the layer argument
    (per layer the op came from) that holds it in a spec."""

    gpt2: str
    llama: str
    arg: tuple[tuple[str, str], ...]  # (layer, argument) pairs; "" for any layer
    family: tuple[tuple[str, str], ...] = ()  # (model_type, its name) where it differs

    def name(self, cfg: HFConfig) -> str:
        """The field's name in cfg's config.json."""
        return dict(self.family).get(cfg.family, self.gpt2 if cfg.kind == "gpt2" else
                                     self.llama)

    def argument(self, layer: str) -> str:
        """The spec argument to write in `layer`."""
        found = dict(self.arg)
        return found.get(layer, found.get("", "?"))


_ACT = Field("activation_function", "hidden_act", (("", "activation"),))
_SCALING = Field("rope_scaling", "rope_scaling", (("attention", "rope_factor"), ("", "factor")))
# (op kind, attr) -> the config field it reads
FIELDS: dict[tuple[str, str], Field] = {
    ("rope", "theta"): Field("rope_theta", "rope_theta", (("attention", "rope"),
                                                          ("", "theta"))),
    ("rope", "factor"): _SCALING,
    ("rope", "low_freq"): Field("rope_scaling", "rope_scaling", (("attention", "rope_low_freq"),
                                                                 ("", "low_freq"))),
    ("rope", "high_freq"): Field("rope_scaling", "rope_scaling",
                                 (("attention", "rope_high_freq"), ("", "high_freq"))),
    ("rope", "original_max"): Field("rope_scaling", "rope_scaling",
                                    (("attention", "rope_original_max"),
                                     ("", "original_max"))),
    ("rmsnorm", "eps"): Field("layer_norm_epsilon", "rms_norm_eps", (("attention", "qk_norm"),
                                                                      ("", "eps"))),
    ("layernorm", "eps"): Field("layer_norm_epsilon", "rms_norm_eps", (("", "eps"),)),
    ("cross_entropy", "classes"): Field("vocab_size", "vocab_size", (("", "classes"),)),
    ("causal_mask", "window"): Field("sliding_window", "sliding_window", (("", "window"),)),
    # the MoE families' router (their fields; the capacity is the family's: none drops)
    ("moe", "top_k"): Field("", "num_experts_per_tok", (("", "top_k"),)),
    ("moe", "normalize"): Field("", "norm_topk_prob", (("", "normalize"),),
                                (("mixtral", "model_type"),)),  # Mixtral's always does
    ("moe", "capacity"): Field("", "model_type", (("", "capacity"),)),
    ("moe", "aux"): Field("", "output_router_logits", (("", "aux"),)),
    ("moe", "activation"): Field("", "hidden_act", (("", "activation"),)),
}
ACTIVATIONS = ("gelu", "relu", "silu")
_ACT_ARG = {("gelu", "tanh"): "gelu_tanh", ("gelu", None): "gelu", ("relu", None): "relu",
            ("silu", None): "silu"}


def _attr_text(value) -> str:
    if isinstance(value, bool):  # as a spec writes it
        return "true" if value else "false"
    return "absent" if value is None else repr(value)


def mismatch_of_op(a: ir.Op, b: ir.Op, cfg: HFConfig, spec: str, model: str) -> HFMismatch:
    """The error for op `a` of the spec where the config's model computes `b`."""
    where = f"{cfg.path}"
    if a.kind in ACTIVATIONS and b.kind in ACTIVATIONS:
        have = _ACT_ARG.get((a.kind, a.attr("approximate")), a.kind)
        want = _ACT_ARG.get((b.kind, b.attr("approximate")), b.kind)
        return HFMismatch(
            f"activation is {have} here ({a.out}), but {where} says {want} (field "
            f"{_ACT.name(cfg)!r}): the weights were trained with the config's",
            f"write activation = {want} in this {a.layer}", a.loc)
    if a.kind == b.kind and a.type == b.type:
        mine, theirs = dict(a.attrs), dict(b.attrs)
        for key in sorted(set(mine) | set(theirs)):
            if mine.get(key) == theirs.get(key) or (a.kind, key) not in FIELDS:
                continue
            f = FIELDS[(a.kind, key)]
            arg = f.argument(a.layer or a.kind)
            return HFMismatch(
                f"{a.kind} {key} is {_attr_text(mine.get(key))} here ({a.out}), but "
                f"{where} says {_attr_text(theirs.get(key))} (field {f.name(cfg)!r}): "
                f"the weights were trained with the config's",
                f"write {arg} = {_attr_text(theirs.get(key))} in this {a.layer or a.kind}"
                if theirs.get(key) is not None else f"drop {arg} from this {a.layer or a.kind}",
                a.loc)
    return HFMismatch(f"{spec}: model {model} is not the {cfg.kind} {cfg.path} describes: it "
                      f"computes {a.out} = {a.kind}{_attrs(a)} where {b.kind}{_attrs(b)} is "
                      f"expected ({b.out})", None, a.loc)


def mismatch_of_head_dim(have: int, cfg: HFConfig, model: ir.Model | None) -> HFMismatch:
    """The error for a head width other than the config's, at the spec's first attention."""
    want = cfg.size("head_dim")
    derived = have * cfg.size("heads") == cfg.size("hidden")
    at = next((op for op in (model.ops if model is not None else ())
               if op.layer == "attention" and op.loc is not None), None)
    return HFMismatch(
        f"attention head_dim is {have} here{' (hidden / heads)' if derived else ''}"
        f"{f' ({at.out})' if at else ''}, but {cfg.path} says {want} (field 'head_dim'): "
        "the weights were trained with the config's",
        f"write head_dim = {want} in this attention (q, k, v: hidden -> heads x {want})"
        if derived else f"make this attention's head_dim {want} (head_dim = {want}, or "
        f"--dim head_dim={want} where head_dim is a declared dim)", at.loc if at else None)


def _attrs(op: ir.Op) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in op.attrs) + ")"


def field_of_param(name: str, cfg: HFConfig) -> tuple[str, str] | None:
    """(what the config says, the spec's arguments to write; {v}: true or false) that decides
    whether param `name` exists, or None. The tie is ("tie_word_embeddings", the statement)."""
    last = name.rsplit(".", 1)[-1]
    fam = cfg.family or cfg.kind
    if fam == "llama" and last in ("bq", "bk", "bv", "bo"):
        return ("attention_bias = {v}", "bias = {v}, qkv_bias = {v}")
    if fam == "qwen2" and last in ("bq", "bk", "bv", "bo"):
        return ("model_type qwen2 (biases on q/k/v_proj, none on o_proj)",
                "qkv_bias = true, bias = false")
    if fam == "mistral" and last in ("bq", "bk", "bv", "bo"):
        return ("model_type mistral (no attention biases)", "qkv_bias = false, bias = false")
    if last in ("q_norm", "k_norm"):
        return ("model_type qwen3 (q and k RMS-normed per head)" if fam == "qwen3" else
                f"model_type {fam} (no q/k norms)",
                f"qk_norm = {cfg.eps!r}" if fam == "qwen3" else "qk_norm = 0.0")
    if fam == "qwen3" and last in ("bq", "bk", "bv", "bo"):
        return ("attention_bias = {v}", "bias = {v}, qkv_bias = {v}")
    if cfg.kind == "llama" and last == "bias" and ".mlp" in name:
        return ("mlp_bias = {v}", "bias = {v}")
    if last == "shared_gate" or ".moe" in name and ".mlp0." in name:
        return ("model_type qwen2_moe (a shared expert, gated by sigmoid(shared_expert_gate))"
                if fam == "qwen2_moe" else f"model_type {fam} (no shared expert)",
                "shared = shared, shared_gate = {v}")
    if name == "linear0.weight":
        return ("tie_word_embeddings", "tie linear0.weight = embedding0.table")
    return None


def place_of_param(name: str, model: ir.Model | None) -> ir.Loc | None:
    """Where the spec makes param `name` (or, when it lacks it, the layer that would)."""
    if model is None:
        return None
    for p in model.params:
        if p.name == name and p.loc is not None:
            return p.loc
    layer = name.rsplit(".", 1)[0] + "."
    return next((op.loc for op in model.ops if op.out.startswith(layer) and op.loc), None)
