"""The text `soapstone explain` prints of an Estimate (explain.py), and the communication rows
`show` prints too."""

from __future__ import annotations

from soapstone.shard.plan import schedules
from soapstone.shard.plan.analysis.explain import Estimate, Traffic
from soapstone.shard.plan.units import format_bytes


def format_traffic(traffic: list[Traffic]) -> list[str]:
    """The communication rows of `explain` (and of `show`): one per phase, kind and axis, then
    a total per axis."""
    lines = [] if traffic else ["  none"]
    per_axis: dict[str, int] = {}
    shown: dict[tuple[str, str, str], Traffic] = {}  # prefetched gathers beside the others
    for t in traffic:
        row = shown.setdefault((t.phase, t.kind, t.axis), Traffic(t.phase, t.kind, t.axis))
        row.calls += t.calls
        row.bytes += t.bytes
    for t in shown.values():
        lines.append(f"  {t.phase:<10} {t.kind:<15} {'[' + t.axis + ']':<12} x{t.calls:<4} "
                     f"{format_bytes(t.bytes):>12}")
        per_axis[t.axis] = per_axis.get(t.axis, 0) + t.bytes
    for axis, n in sorted(per_axis.items()):
        lines.append(f"  {'total':<26} {'[' + axis + ']':<12} {'':<5}{format_bytes(n):>12}")
    return lines


def format_estimate(e: Estimate) -> str:
    """The table `soapstone explain` prints."""
    mesh = " x ".join(f"{a}={s}" for a, s in e.mesh.items()) or "single rank"
    who = "every rank alike" if e.pipe_rank is None else \
        f"pipe rank {e.pipe_rank}, the largest; the ranks of one pipe rank alike"
    lines = [f"explain {e.model}" + (f" / {e.parallel}" if e.parallel else "") +
             f"  mesh({mesh})  {e.world_size} rank{'s' if e.world_size > 1 else ''}, "
             f"zero {e.zero}, {e.optimizer}",
             f"memory per rank ({who}):",
             f"  params        {format_bytes(e.param_bytes):>12}" + (
                 f"   ({e.compute_dtype} model copy + fp32 masters "
                 f"{format_bytes(e.master_bytes)})" if e.master_bytes else ""),
             f"  grads         {format_bytes(e.grad_bytes):>12}   (fp32 buffers)",
             f"  optimizer     {format_bytes(e.optimizer_bytes):>12}   (fp32 state)",
             f"  activations   {format_bytes(e.activation_bytes):>12}   (what backward keeps"
             + (", x microbatches in flight)" if e.pipe_rank is not None else ")"),
             f"  working set   {format_bytes(e.transient_bytes):>12}   (above them at the peak: "
             "values to read, gradients in flight)",
             f"  total         {format_bytes(e.total_bytes):>12}"]
    if e.without_recompute is not None:
        saved, work = e.without_recompute
        lines.append(f"  (recompute: without it activations {format_bytes(saved)}, working set "
                     f"{format_bytes(work)};")
        lines.append(f"   backward runs {e.recompute_flops / 1e9:.3g} GFLOP of the forward "
                     "again per microbatch)")
    lines.append("communication per training step (bytes this rank sends, ring convention):")
    lines.extend(format_traffic(e.traffic))
    for m in e.experts:
        lines.append(f"  {m['op']}: {m['per_rank']} of {m['experts']} experts per rank "
                     f"({format_bytes(m['param_bytes'])} of expert params)" + (
                         f"; alltoallv bytes are expected at the capacity bound ({m['bound']} "
                         f"of {m['choices']} choices kept, spread evenly over the ranks)"
                         if m["exchange"] else ""))
    if e.pipe_rank is None:
        lines.append(f"pipeline: {e.stages} stage{'s' if e.stages > 1 else ''}, bubble "
                     f"{e.bubble:.3f}, stage imbalance {e.imbalance:.2f}")
        return "\n".join(lines) + "\n"
    p = len(e.pipe_ranks)
    formula = schedules.get(e.schedule).formula(p, e.microbatches, e.stages // p)
    lines.append(f"pipeline: {e.stages} virtual stages on {p} pipe ranks, {e.schedule}, "
                 f"{e.microbatches} microbatches: bubble {e.bubble:.3f} = {formula}, stage "
                 f"imbalance {e.imbalance:.2f} (parameter elements, largest rank / mean)")
    if schedules.get(e.schedule).memory:
        lines.append(f"  {e.schedule} memory: {schedules.get(e.schedule).memory}")
    lines.append("  per pipe rank (memory, activations in flight, bytes sent per step):")
    for r in e.pipe_ranks:
        per_mb = r["activation_bytes_per_microbatch"]
        flight = ", ".join(f"stage {s}: {n} x {format_bytes(per_mb[s])}"
                           for s, n in r["microbatches_in_flight"].items())
        lines.append(f"  rank {r['pipe_rank']}  params {format_bytes(r['param_bytes'])}  "
                     f"grads {format_bytes(r['grad_bytes'])}  "
                     f"optimizer {format_bytes(r['optimizer_bytes'])}  "
                     f"activations {format_bytes(r['activation_bytes'])} ({flight} in flight)  "
                     f"sends {format_bytes(r['comm_bytes'])}")
    for d in e.edges:
        if d["src_rank"] == d["dst_rank"]:  # a V's turn: two stages of one rank
            lines.append(f"  edge {d['src']} -> {d['dst']}  on pipe rank {d['src_rank']}: "
                         "handed over in memory, no p2p")
            continue
        lines.append(f"  edge {d['src']} -> {d['dst']}  p2p per step: activations "
                     f"{format_bytes(d['activation_bytes'])}, gradients back "
                     f"{format_bytes(d['gradient_bytes'])}")
    return "\n".join(lines) + "\n"
