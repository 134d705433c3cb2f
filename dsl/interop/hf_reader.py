"""A rank's slices of soapstone params read straight out of Hugging Face safetensors.

`HFReader.read("param/NAME", box, dtype)` (the checkpoint reader protocol fill_shares drives,
shard/checkpoint/load.py) reads from the Hugging Face tensor holding NAME only the rows and
columns that hold `box` (safetensors `get_slice`), then undoes the layout change of
hf_tensors.tensor_map (transposed, heads flattened, q/k/v side by side). A rank of tp4
reads about a quarter of each split weight, never a full tensor; a rank holding some of a
stack of experts reads only its experts' tensors. The only bytes read beyond
the box are the inner dims of a flattened pair a box splits inside (head_dim, which no layout
splits).

What it reads is checked where the file and the tensor are known: integers (the headers were
checked before launch; a file changed since) and NaN or infinity are a CheckpointError naming
the safetensors file, the Hugging Face tensor and the param it fills (fill_shares' own checks
know only the param).
"""

from __future__ import annotations

import math

from soapstone.dsl.interop.hf_files import TensorEntry
from soapstone.dsl.interop.hf_tensors import HFTensor
from soapstone.shard.checkpoint.boxes import Box

# the most bytes one read brings in (see read_into)
CHUNK_BYTES = 4 << 20
# per layout change, the param dim along which the Hugging Face tensor's rows run (the dim a
# piece of consecutive rows covers): [b, a] -> [a, b] and (d1 x rest, a) -> [a, d1, ...] by
# their second dim, (b, d0 x mid) -> [d0, ..., b] by the last, the rest by the first
LEAD = {"t": 1, "cols_t": 1, "rows_t": -1}


class HFReader:
    """Reads param boxes from a save_pretrained directory's safetensors (open files cached)."""

    def __init__(self, tensors: list[HFTensor], entries: dict[str, TensorEntry],
                 shapes: dict[str, tuple[int, ...]], chunk_bytes: int = CHUNK_BYTES,
                 real: dict[str, tuple[int, ...]] | None = None):
        # param -> (its HF tensor, its index among the tensor's params); a param stored as
        # one tensor per expert: the first, and all of them in `parts`, by expert
        self.where: dict[str, tuple[HFTensor, int]] = {}
        self.parts: dict[str, list[HFTensor]] = {}
        for t in tensors:
            for k, p in enumerate(t.params):
                self.where.setdefault(p, (t, k))
                if t.index is not None:
                    self.parts.setdefault(p, []).append(t)
        for stack in self.parts.values():
            stack.sort(key=lambda t: t.index)
        self.entries = entries
        self.shapes = shapes  # param -> full shape
        self.chunk_bytes = chunk_bytes
        # param -> its shape in the files: smaller than `shapes` along a padded vocab, whose
        # rows beyond it read as zeros
        self.real = real or shapes
        self.bytes_read = 0

    def _slice(self, name: str, index: tuple[slice, ...]):
        from safetensors import safe_open

        from soapstone.shard.checkpoint.index import CheckpointError

        file = self.entries[name].file
        try:  # the headers were checked before launch: this is a file changed or damaged since
            # opened per read and let go at once: the file is memory-mapped, and the pages a
            # read touches count as this process's memory for as long as the map lives
            with safe_open(str(file), "pt") as f:
                part = f.get_slice(name)[index]
        except Exception as e:  # noqa: BLE001 - safetensors raises its own, untyped errors
            # a CheckpointError: fill_shares makes every rank stop with it together
            raise CheckpointError(f"{file}: reading tensor {name}: {e}") from None
        self.bytes_read += part.numel() * part.element_size()
        return part

    def read(self, tensor: str, box, dtype):
        """The region `box` of param `tensor` ("param/NAME"), as `dtype` (zeros where it
        reaches past the files' shape: a padded vocab)."""
        import torch

        name = tensor.split("/", 1)[1]
        real = self.real[name]
        if tuple(real) == tuple(self.shapes[name]):
            return self._read(name, box, dtype)
        inside = box.intersect(Box((0,) * len(real), tuple(real)))
        if inside == box:  # no padding in this piece: no buffer for zeros
            return self._read(name, box, dtype)
        out = torch.zeros(box.shape, dtype=dtype)
        if inside is not None:
            out[inside.within(box)] = self._read(name, inside, dtype)
        return out

    def _read(self, name: str, box, dtype):
        import torch

        if name in self.parts:  # experts [e0, e1) of a stack: each from its own tensor
            o, n = box.offset, box.shape
            return torch.stack([self._piece(t, 0, self.real[name][1:], o[1:], n[1:], dtype)
                                for t in self.parts[name][o[0]:o[0] + n[0]]])
        t, k = self.where[name]
        return self._piece(t, k, self.real[name], box.offset, box.shape, dtype)

    def _piece(self, t: HFTensor, k: int, s, o, n, dtype):
        """The region (offset o, shape n) of the k-th param (shape s) tensor t holds."""
        if t.how == "same":
            x = self._slice(t.name, tuple(slice(a, a + m) for a, m in zip(o, n, strict=True)))
        elif t.how == "t":  # [a, b] <- [b, a]
            x = self._slice(t.name, (slice(o[1], o[1] + n[1]), slice(o[0], o[0] + n[0]))).T
        elif t.how == "flat":  # [d0, *rest] <- a run of a 1-d tensor, after the params before
            base = sum(math.prod(self.real[p]) for p in t.params[:k])
            inner = math.prod(s[1:])
            x = self._slice(t.name, (slice(base + o[0] * inner, base + (o[0] + n[0]) * inner),))
            x = _rest(x.reshape(n[0], *s[1:]), o, n, 1)
        elif t.how == "cols":  # [a, d1, *rest] <- columns of [a, sum], after the params before
            base = sum(math.prod(self.real[p][1:]) for p in t.params[:k])
            inner = math.prod(s[2:])
            x = self._slice(t.name, (slice(o[0], o[0] + n[0]),
                                     slice(base + o[1] * inner, base + (o[1] + n[1]) * inner)))
            x = _rest(x.reshape(n[0], n[1], *s[2:]), o, n, 2)
        elif t.how == "cols_t":  # [a, d1, *rest] <- rows (d1 x rest) by columns (a)
            inner = math.prod(s[2:])
            x = self._slice(t.name, (slice(o[1] * inner, (o[1] + n[1]) * inner),
                                     slice(o[0], o[0] + n[0])))
            x = _rest(x.T.reshape(n[0], n[1], *s[2:]), o, n, 2)
        elif t.how == "rows":  # [d0, *mid, b] <- rows (d0 x mid) by columns (b)
            inner = math.prod(s[1:-1])
            x = self._slice(t.name, (slice(o[0] * inner, (o[0] + n[0]) * inner),
                                     slice(o[-1], o[-1] + n[-1])))
            x = _mid(x.reshape(n[0], *s[1:-1], n[-1]), o, n)
        elif t.how == "rows_t":  # [d0, *mid, b] <- rows (b) by columns (d0 x mid)
            inner = math.prod(s[1:-1])
            x = self._slice(t.name, (slice(o[-1], o[-1] + n[-1]),
                                     slice(o[0] * inner, (o[0] + n[0]) * inner)))
            x = _mid(x.T.reshape(n[0], *s[1:-1], n[-1]), o, n)
        elif t.how == "row":  # [b] <- [1, b]
            x = self._slice(t.name, (slice(0, 1), slice(o[0], o[0] + n[0])))[0]
        else:
            raise AssertionError(t.how)
        check_read(x, f"{self.entries[t.name].file}: tensor {t.name} (param/{t.params[k]})",
                   t.params[k])  # still in the file's dtype, cut to the box
        return x.to(dtype).contiguous()

    def read_into(self, tensor: str, box, dest) -> None:
        """`box` of param `tensor` into `dest` (its flat storage), a piece of at most
        chunk_bytes at a time along the dim the Hugging Face tensor's rows run, so the
        memory a load needs beyond the parameters stays one piece, whatever the tensor."""
        name = tensor.split("/", 1)[1]
        t, _ = self.where[name]
        inner = 1 if name in self.parts else 0  # an expert stack: its experts' own rows
        d = inner + LEAD.get(t.how, 0) % max(len(box.shape) - inner, 1)
        if not box.shape:
            dest.copy_(self.read(tensor, box, dest.dtype).reshape(-1))
            return
        out = dest.view(box.shape)
        row = max(box.numel // box.shape[d], 1) * dest.element_size()
        step = max(self.chunk_bytes // row, 1)
        for a in range(0, box.shape[d], step):
            m = min(step, box.shape[d] - a)
            part = Box(tuple(o + a if i == d else o for i, o in enumerate(box.offset)),
                       tuple(m if i == d else n for i, n in enumerate(box.shape)))
            out.narrow(d, a, m).copy_(self.read(tensor, part, dest.dtype))

    def close(self) -> None:
        """Nothing stays open between reads (see _slice)."""


def check_read(part, where: str, param: str) -> None:
    """CheckpointError naming `where` (file, tensor and param) when what was read of a float
    param is not floats, or holds NaN or infinity."""
    import torch

    from soapstone.shard.checkpoint.index import CheckpointError

    if not part.is_floating_point():
        raise CheckpointError(f"{where} is {str(part.dtype).removeprefix('torch.')}, but the "
                              f"model's {param} is a float tensor; give weights saved as "
                              "floats (integers would be cast and train silently)")
    if not bool(torch.isfinite(part).all()):
        raise CheckpointError(f"{where} holds NaN or infinity; load finite weights: download "
                              "the file again, or fix the tensor where the weights were made")


def _rest(x, o, n, first: int):
    """x (whole along dims first..) cut to the box along those dims."""
    index = (slice(None),) * first + tuple(slice(a, a + m) for a, m in
                                           zip(o[first:], n[first:], strict=True))
    return x[index]


def _mid(x, o, n):
    """x (whole along the dims between the first and the last) cut to the box there."""
    index = (slice(None),) + tuple(slice(a, a + m) for a, m in
                                   zip(o[1:-1], n[1:-1], strict=True)) + (slice(None),)
    return x[index]
