"""The weight files of a save_pretrained directory, checked from their headers before launch.

`weight_files(DIR)` says which safetensors file holds each tensor (model.safetensors, or the
shards of model.safetensors.index.json); `read_headers` reads each file's header (8 bytes of
length, then JSON: per tensor its dtype, shape and byte range) without its data, and proves the
file holds every byte the header promises (a truncated download is caught here, not halfway
through loading). `check_tensors` compares every tensor the model needs with the shape it
needs. Every problem is an HFError naming the file and the tensor, and since every rank reads
the same files it reaches the same verdict.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import attrs

from soapstone.dsl.interop.hf_config import HFConfig, HFError

# safetensors dtypes a float parameter can be read from
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# buffers some checkpoints carry that are no parameters (GPT-2's causal mask, rotary tables)
BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
MAX_HEADER = 100 << 20  # safetensors' own limit on a header's size


@attrs.frozen
class TensorEntry:
    """One tensor as a file's header describes it."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or a sharded index)."""
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index.exists():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
            return {str(k): directory / str(v) for k, v in wmap.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise HFError(f"{index}: not a safetensors index ({e})") from None
    if single.exists():
        return dict.fromkeys(read_header(single), single)
    hint = None
    if (directory / "pytorch_model.bin").exists():
        hint = ("it has pytorch_model.bin, a pickle soapstone does not read: convert it with "
                "transformers (`AutoModelForCausalLM.from_pretrained(DIR)."
                "save_pretrained(DIR, safe_serialization=True)`)")
    raise HFError(f"{directory}: no model.safetensors or model.safetensors.index.json", hint)


def read_header(file: Path) -> dict[str, TensorEntry]:
    """A safetensors file's tensors from its header; HFError if the header is unreadable or
    the file is shorter than the data it describes."""
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HFError(f"{file}: not a safetensors file ({len(head)} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise HFError(f"{file}: not a safetensors file (a header of {n} bytes)")
            raw = f.read(n)
        size = file.stat().st_size
    except OSError as e:
        raise HFError(f"{file}: cannot read it ({e.strerror})") from None
    if len(raw) < n:
        raise HFError(f"{file}: truncated: its header needs {n} bytes, the file has "
                      f"{len(raw)} after the length", "download the file again")
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise HFError(f"{file}: not a safetensors file (header: {e})") from None
    out: dict[str, TensorEntry] = {}
    end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            out[name] = TensorEntry(file, str(meta["dtype"]),
                                    tuple(int(d) for d in meta["shape"]))
            end = max(end, int(meta["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise HFError(f"{file}: tensor {name} has a malformed header entry") from None
    if size < 8 + n + end:
        last = max(out, key=lambda t: int(header[t]["data_offsets"][1]))
        raise HFError(f"{file}: truncated: it has {size} bytes, its tensors (the last, {last}) "
                      f"need {8 + n + end}", "download the file again")
    return out


def read_headers(directory: Path) -> dict[str, TensorEntry]:
    """Every tensor of DIR's weights, by name, from the headers of its files."""
    files = weight_files(directory)
    entries: dict[str, TensorEntry] = {}
    headers: dict[Path, dict[str, TensorEntry]] = {}
    for name, file in files.items():
        if file not in headers:
            if not file.is_file():
                raise HFError(f"{file}: no such file (the index names it for tensor {name})")
            headers[file] = read_header(file)
        if name not in headers[file]:
            raise HFError(f"{file}: the index places tensor {name} here, but the file lacks it")
        entries[name] = headers[file][name]
    return entries


def check_tensors(directory: Path, cfg: HFConfig, entries: dict[str, TensorEntry],
                  wanted: dict[str, tuple[tuple[int, ...], list[str]]]) -> None:
    """Every tensor in `wanted` (name -> (shape, dim labels)) is there with that shape and a
    float dtype, and no tensor is there that the model has no place for (HFError)."""
    for name, e in entries.items():
        if name not in wanted and not name.endswith(BUFFERS) and not (
                cfg.tied and name == "lm_head.weight"):
            raise HFError(f"{e.file}: tensor {name} has no place in the {cfg.kind} of "
                          f"{cfg.path}", "the config and the weights disagree")
    for name, (want, labels) in wanted.items():
        if name not in entries:
            hint = None
            if name == "lm_head.weight":
                hint = (f"{cfg.path} sets tie_word_embeddings = false, so the head is its own "
                        "tensor: save it, or set tie_word_embeddings = true and tie the head "
                        "in the spec (tie linear0.weight = embedding0.table)")
            raise HFError(f"{directory}: the weights lack tensor {name}", hint)
        e = entries[name]
        if e.dtype not in FLOAT_DTYPES:
            raise HFError(f"{e.file}: tensor {name} is {e.dtype}; a parameter needs one of "
                          f"{', '.join(FLOAT_DTYPES)}",
                          "give weights saved as floats (integers would be cast and train "
                          "silently; a quantized export needs its unquantized weights)")
        if e.shape != want:
            shape_error(e.file, name, e.shape, want, labels)


def shape_error(file: Path, name: str, got, want, labels: list[str]) -> None:
    """The HFError for a tensor of another shape: both shapes and the first dim that differs."""
    if len(got) != len(want):
        raise HFError(f"{file}: tensor {name} has shape {list(got)}, the model expects "
                      f"{list(want)} ({', '.join(labels)}): {len(got)} dims, not {len(want)}")
    j = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    raise HFError(f"{file}: tensor {name} has shape {list(got)}, the model expects "
                  f"{list(want)} ({', '.join(labels)}): dim {j} ({labels[j]}) is {got[j]} "
                  f"there and {want[j]} here",
                  f"make config.json and the weights agree on {labels[j]}")
