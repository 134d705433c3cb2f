"""Where `run --init SOURCE` (and `generate`) takes a model's initial weights from.

SOURCE is a safetensors file of full, unsharded parameters (`soapstone ckpt export` writes
one; key = parameter name), a checkpoint directory (its latest complete checkpoint's
parameters), or `SCHEME:REST` for a scheme registered in SCHEMES (Hugging Face import, `hf:DIR`,
registers there). This is the one place the prefix is dispatched on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from soapstone.dsl.lang.errors import BadInput

# scheme -> (check(rest, graph, model) before launch: raises UserError,
#            load(executor, rest) -> a line,
#            tokenizer(rest) -> the path of the source's tokenizer.json or None)
SCHEMES: dict[str, tuple[Callable[[str, object, object], None],
                         Callable[[object, str], str],
                         Callable[[str], str | None]]] = {}


def _scheme(text: str):
    prefix, sep, rest = text.partition(":")
    return (SCHEMES[prefix], rest) if sep and prefix in SCHEMES else (None, text)


def check_init(text: str, graph, model=None) -> None:
    """--init's source exists, is a kind it can read and holds exactly the parameters of
    `graph`'s model with their shapes (UserError otherwise; reads no tensor data). `model`
    (the spec's IR) lets a source that describes a computation (hf:DIR's config) prove the
    spec computes it, at the spec's lines."""
    scheme, rest = _scheme(text)
    if scheme is not None:
        scheme[0](rest, graph, model)
        return
    p = Path(text)
    if p.is_file() and p.suffix != ".safetensors":
        raise BadInput(f"--init {text}: not a .safetensors file; give full parameters as "
                       "safetensors (`soapstone ckpt export DIR -o FILE.safetensors`) or a "
                       "checkpoint directory")
    if not p.exists():
        raise BadInput(f"--init {text}: no such file or directory; give a .safetensors file of "
                       "full parameters or a checkpoint directory")
    from soapstone.shard.checkpoint.load import open_params

    open_params(p, graph)


def init_tokenizer(text: str | None) -> str | None:
    """The tokenizer that comes with --init's source (a Hugging Face directory's
    tokenizer.json), or None when it has none."""
    if not text:
        return None
    scheme, rest = _scheme(text)
    if scheme is None or len(scheme) < 3:
        return None
    return scheme[2](rest)


def load_init(executor, text: str) -> str:
    """Load --init's weights into `executor` (any layout; each rank reads its slices);
    a line saying what was loaded. Collective."""
    scheme, rest = _scheme(text)
    if scheme is not None:
        return scheme[1](executor, rest)
    from soapstone.shard.checkpoint import load_params

    return load_params(executor, text)


def _hf_check(rest: str, graph, model) -> None:
    from soapstone.dsl.interop import hf

    hf.check_graph(rest, graph, model)


def _hf_load(executor, rest: str) -> str:
    from soapstone.dsl.interop import hf

    return hf.load_init(executor, rest)


def _hf_tokenizer(rest: str) -> str | None:
    found = Path(rest) / "tokenizer.json"
    return str(found) if found.is_file() else None


# a Hugging Face GPT-2 / LLaMA directory (dsl/interop/hf.py)
SCHEMES["hf"] = (_hf_check, _hf_load, _hf_tokenizer)
