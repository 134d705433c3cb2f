"""A custom layer: SwiGLU (Shazeer 2020), as used by LLaMA's feed-forward blocks.

    soapstone check examples/swiglu.par --plugin examples/custom_layer.py

The signature is in named dims: `hidden` binds to x's last dim, `ffn` to the dim passed after x
(`swiglu(x, ffn)`). `shard={"ffn": "partial"}` tells the compiler that ffn may be split over a
mesh axis, in which case each rank's output is a partial sum (it inserts the allreduce).
The function runs on LOCAL shards; torch is imported only when it runs, so `soapstone check`
stays fast.
"""

import soapstone.dsl


@soapstone.dsl.layer(
    "swiglu",
    inputs=["x[..., hidden]"],
    params={
        "w1": ("[hidden, ffn]", "normal(0.02)"),
        "w3": ("[hidden, ffn]", "normal(0.02)"),
        "w2": ("[ffn, hidden]", "normal(0.02)"),
    },
    output="[..., hidden]",
    dims=("ffn",),
    shard={"ffn": "partial"},
)
def swiglu(x, w1, w3, w2):
    """silu(x @ w1) * (x @ w3) @ w2."""
    import torch.nn.functional as F

    return (F.silu(x @ w1) * (x @ w3)) @ w2
