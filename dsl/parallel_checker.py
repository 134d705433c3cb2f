"""Semantics of a parallel block (-> ir.Parallel), checked against its model before launch.

The mesh axes exist and are used; each dim maps to at most one axis and divides over it;
`sample` maps the batch dim; a tensor (input or parameter) splits along at most one dim per
axis; `operator` places repeat blocks on pipeline stages (every block
once, stages in order, none empty) or branches (top-level values) on coordinates of an axis;
the schedule's microbatches divide the per-replica batch; `schedule` needs pipeline stages and
`zero N` (N >= 1) a sample mapping. Pure Python; never imports torch.
"""

from __future__ import annotations

from . import ast
from .errors import Diagnostic, did_you_mean, nearest_divisible
from .ir import Branch, Loc, Model, Parallel, Schedule, StageAssignment
from .parser import Sources

SCHEDULES = ("gpipe", "1f1b", "interleaved")
SCHEDULE_OPTIONS = ("microbatches", "chunks")


class _ParallelChecker:
    def __init__(self, p: ast.ParallelDef, model: Model, sources: Sources):
        self.p = p
        self.m = model
        self.sources = sources
        self.diags: list[Diagnostic] = []
        self.dims = dict(model.dims)

    def err(self, loc, message, hint=None) -> None:
        self.diags.append(self.sources.diag(loc, message, hint, self.p.file))

    def check(self) -> Parallel | None:
        p, m = self.p, self.m
        mesh: dict[str, int] = {}
        for axis, size, loc in p.mesh:
            if axis in mesh:
                self.err(loc, f"mesh axis '{axis}' is declared twice")
            elif size < 1:
                self.err(loc, f"mesh axis '{axis}' has size {size}; sizes must be >= 1")
            else:
                mesh[axis] = size
        self.mesh = mesh
        used_axes: dict[str, str] = {}  # axis -> what uses it
        mapped: dict[str, tuple[str, str]] = {}  # dim -> (kind, axis)
        map_loc: dict[str, Loc] = {}  # dim -> where it is mapped
        soap: dict[str, list[tuple[str, str]]] = {"sample": [], "attribute": [], "parameter": []}
        failed: set[str] = set()  # statement kinds with a mapping rejected above
        operator: list[StageAssignment] = []
        branches: list[Branch] = []
        schedule = None
        zero = 0
        seen_kw: dict[str, Loc] = {}
        batch = m.inputs[0].type.dims[0] if m.inputs and m.inputs[0].type.dims else None
        param_dims = {d for prm in m.params for d in prm.type.dims}
        pipe_axis = None
        has_stages = False
        for s in p.body:
            kw = type(s).__name__
            if isinstance(s, (ast.ScheduleStmt, ast.Zero, ast.Operator)):
                if kw in seen_kw:
                    self.err(s.loc, f"a second '{kw.replace('Stmt', '').lower()}' statement",
                             "put everything in one statement")
                    continue
                seen_kw[kw] = s.loc
            if isinstance(s, ast.Soap):
                for dims, axis, axis_loc in s.groups:
                    axis_ok = self.axis(axis, axis_loc)
                    for d, loc in dims:
                        if d not in self.dims:
                            self.err(loc, f"model '{m.name}' has no dim '{d}'",
                                     did_you_mean(d, self.dims))
                            continue
                        if d in mapped:
                            k, ax = mapped[d]
                            self.err(loc, f"dim '{d}' is already mapped ({k} {d} -> {ax})",
                                     "a dim maps to at most one mesh axis")
                            continue
                        if s.kind == "sample" and d != batch:
                            self.err(loc, f"sample maps the batch dim '{batch}' (the inputs' "
                                     f"leading dim), not '{d}'",
                                     f"use 'attribute {d} -> {axis}' to split a data dim")
                            continue
                        if s.kind == "sample" and soap["sample"]:
                            self.err(loc, "only one sample mapping is allowed")
                            continue
                        if s.kind == "parameter" and d not in param_dims:
                            self.err(loc, f"'{d}' is no dim of any parameter",
                                     f"use 'attribute {d} -> {axis}' to split activations")
                            continue
                        if s.kind == "attribute" and d == batch:
                            self.err(loc, f"'{d}' is the batch dim; split it with sample",
                                     f"sample {d} -> {axis}")
                            continue
                        if not axis_ok:
                            continue
                        size, n = self.dims[d], mesh[axis]
                        if size % n:
                            self.err(loc, f"{d} = {size} does not divide over {axis} = {n}",
                                     f"{nearest_divisible(size, n)} (--dim {d}=...)")
                            # the statement still uses the axis: no second error from it
                            used_axes.setdefault(axis, s.kind)
                            failed.add(s.kind)
                            continue
                        mapped[d] = (s.kind, axis)
                        map_loc[d] = loc
                        soap[s.kind].append((d, axis))
                        used_axes.setdefault(axis, s.kind)
            elif isinstance(s, ast.Operator):
                stage_defs = [d for d in s.stages if not isinstance(d, ast.BranchDef)]
                branch_defs = [d for d in s.stages if isinstance(d, ast.BranchDef)]
                branches = self.branches(branch_defs)
                for d in branch_defs:  # even a bad placement uses its axis: no second error
                    used_axes.setdefault(d.axis, "branch")
                has_stages = has_stages or bool(stage_defs)
                if stage_defs:
                    operator, pipe_axis = self.operator(ast.Operator(stage_defs, s.loc))
                    if pipe_axis:
                        used_axes[pipe_axis] = "operator"
            elif isinstance(s, ast.ScheduleStmt):
                schedule = s
            elif isinstance(s, ast.Zero):
                if not 0 <= s.level <= 3:
                    self.err(s.loc, f"zero {s.level}: the ZeRO stage is 0, 1, 2 or 3")
                else:
                    zero = s.level
        for b in branches:
            if used_axes.get(b.axis) != "branch":
                self.err(b.loc, f"axis '{b.axis}' places branches and cannot also "
                         f"{'hold pipeline stages' if b.axis == pipe_axis else 'split dims'}",
                         "give the branches their own mesh axis")
        for ax in {ax for _, ax in soap["sample"] + soap["attribute"] + soap["parameter"]}:
            if pipe_axis is not None and ax == pipe_axis:
                self.err(seen_kw["Operator"], f"axis '{ax}' holds pipeline stages and cannot "
                         "also split dims", "give the pipeline its own mesh axis")
        for axis, size, loc in p.mesh:
            if size > 1 and axis in mesh and axis not in used_axes:
                if axis.startswith("pipe") or axis.startswith("stage"):
                    self.err(loc, f"mesh axis '{axis}' (size {size}) has no operator statement",
                             f"add: operator <repeat>[0..k] -> {axis} 0, ...")
                else:
                    self.err(loc, f"mesh axis '{axis}' (size {size}) is used by no statement",
                             f"map a dim to it (sample {batch} -> {axis}), or make its size 1")
        self.one_dim_per_axis(soap, map_loc)
        if zero >= 1 and not soap["sample"] and "sample" not in failed:
            self.err(seen_kw["Zero"], f"zero {zero} shards optimizer state over the sample "
                     "(data-parallel) axis, but no sample statement maps the batch",
                     f"add: sample {batch} -> AXIS, or use zero 0")
        sched = Schedule()
        if schedule is not None:
            # a sample mapping that failed leaves the per-replica batch unknown: don't guess
            sched = self.schedule(schedule, soap["sample"], pipe_axis,
                                  None if "sample" in failed else batch, operator)
            if not has_stages:
                self.err(schedule.loc, "a schedule statement without pipeline stages does nothing",
                         "add: operator <repeat>[0..k] -> pipe 0, ...; or remove the schedule")
        if self.diags:
            return None
        return Parallel(p.name, p.model, tuple(p_ for p_ in mesh.items()),
                        tuple(soap["sample"]), tuple(soap["attribute"]),
                        tuple(soap["parameter"]), tuple(operator), sched, zero, p.loc,
                        tuple(branches))

    def one_dim_per_axis(self, soap, map_loc: dict[str, Loc]) -> None:
        """A tensor splits along at most one of its dims per mesh axis: an input (sample and
        attribute mappings) or a parameter (parameter mappings) with two dims mapped to one
        axis is an error (the lowering would keep the first and drop the second)."""
        order = {d: i for i, d in enumerate(map_loc)}
        leaves = [(f"input '{i.name}'", i.type.dims, soap["sample"] + soap["attribute"])
                  for i in self.m.inputs]
        leaves += [(f"parameter '{prm.name}'", prm.type.dims, soap["parameter"])
                   for prm in self.m.params]
        seen: set[tuple[str, str]] = set()
        for what, dims, mapping in leaves:
            first: dict[str, str] = {}  # axis -> the first mapped dim of this tensor on it
            for d, axis in sorted(mapping, key=lambda m: order[m[0]]):
                if d not in dims:
                    continue
                if axis not in first:
                    first[axis] = d
                    continue
                if (first[axis], d) in seen:
                    continue
                seen.add((first[axis], d))
                self.err(map_loc[d], f"{what} [{', '.join(dims)}] would split both "
                         f"'{first[axis]}' and '{d}' over axis '{axis}'; a tensor splits "
                         "along at most one dim per mesh axis",
                         f"map '{d}' to another mesh axis")

    def branches(self, defs: list) -> list[Branch]:
        """`operator a -> branch 0`: top-level values assigned once, on an existing axis."""
        m = self.m
        top = {op.out for op in m.ops if op.block is None}
        outputs = {o.value for o in m.outputs}
        out: list[Branch] = []
        seen: set[str] = set()
        for d in defs:
            if d.value in seen:
                self.err(d.loc, f"value '{d.value}' is placed twice")
                continue
            seen.add(d.value)
            if d.value not in top:
                self.err(d.loc, f"'{d.value}' is no top-level value of model '{m.name}'",
                         did_you_mean(d.value, top) or "branches name values assigned "
                         "outside repeat blocks")
                continue
            if f"{d.value}.1" in top:
                self.err(d.loc, f"'{d.value}' is assigned more than once; a branch names "
                         "one value", "give the branch's result its own name")
                continue
            if d.value in outputs:
                self.err(d.loc, f"'{d.value}' is a model output; a branch must feed later ops",
                         "place the ops before the output instead")
                continue
            if not self.axis(d.axis, d.axis_loc):
                continue
            if not 0 <= d.coord < self.mesh[d.axis]:
                self.err(d.coord_loc, f"{d.axis} {d.coord} is out of range: axis '{d.axis}' "
                         f"has size {self.mesh[d.axis]} (0..{self.mesh[d.axis] - 1})")
                continue
            out.append(Branch(d.value, d.axis, d.coord, d.loc))
        return out

    def axis(self, axis: str, loc: Loc) -> bool:
        if axis in self.mesh:
            return True
        self.err(loc, f"mesh has no axis '{axis}'",
                 did_you_mean(axis, self.mesh) or f"axes: {', '.join(self.mesh)}")
        return False

    def operator(self, s: ast.Operator):
        m = self.m
        repeats: dict[str, list[str]] = {}
        for b in m.blocks:
            repeats.setdefault(b.rsplit(".", 1)[0], []).append(b)
        owner: dict[str, tuple[int, Loc]] = {}
        out: list[StageAssignment] = []
        axis = None
        ok = True
        for sd in s.stages:
            if sd.repeat not in repeats:
                self.err(sd.loc, f"model '{m.name}' has no repeat '{sd.repeat}'",
                         did_you_mean(sd.repeat, repeats) or
                         (f"repeats: {', '.join(repeats)}" if repeats else
                          "pipeline stages hold repeat blocks; the model has none"))
                ok = False
                continue
            if axis is None:
                if not self.axis(sd.axis, sd.axis_loc):
                    return [], None
                axis = sd.axis
            elif sd.axis != axis:
                self.err(sd.axis_loc, f"all stages must use one mesh axis ('{axis}')")
                ok = False
                continue
            n = len(repeats[sd.repeat])
            if sd.lo > sd.hi:
                self.err(sd.range_loc, f"empty range [{sd.lo}..{sd.hi}]", "write [low..high]")
                ok = False
                continue
            if sd.hi >= n:
                self.err(sd.range_loc, f"{sd.repeat} has {n} blocks (0..{n - 1}); "
                         f"[{sd.lo}..{sd.hi}] is out of range")
                ok = False
                continue
            if not 0 <= sd.stage < self.mesh[axis]:
                self.err(sd.stage_loc, f"stage {sd.stage} is out of range: axis '{axis}' has "
                         f"{self.mesh[axis]} stages (0..{self.mesh[axis] - 1})")
                ok = False
                continue
            blocks = repeats[sd.repeat][sd.lo: sd.hi + 1]
            for b in blocks:
                if b in owner:
                    self.err(sd.range_loc, f"block {b} is assigned twice",
                             f"it is already on {axis} {owner[b][0]}")
                    ok = False
                owner[b] = (sd.stage, sd.range_loc)
            out.append(StageAssignment(tuple(blocks), axis, sd.stage, sd.loc))
        if not ok or axis is None:
            return out, axis
        missing = [b for b in m.blocks if b not in owner]
        if missing:
            self.err(s.loc, f"block {missing[0]} is assigned to no stage"
                     + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""),
                     "every repeat block goes to exactly one stage")
            return out, axis
        self.stage_seq = [owner[b][0] for b in m.blocks]
        self.stage_locs = [owner[b][1] for b in m.blocks]
        used = set(self.stage_seq)
        empty = [i for i in range(self.mesh[axis]) if i not in used]
        if empty:
            self.err(s.loc, f"{axis} stage {empty[0]} gets no block",
                     "every stage needs at least one block")
        return out, axis

    def order_ok(self, interleaved: bool, chunks: int, nstages: int, loc) -> None:
        seq = getattr(self, "stage_seq", None)
        if not seq:
            return
        runs = [seq[0]] + [b for a, b in zip(seq, seq[1:], strict=False) if a != b]
        if interleaved:
            want = list(range(nstages)) * chunks
            if runs != want:
                self.err(loc, f"interleaved stages must cycle 0..{nstages - 1} {chunks} times "
                         f"over the blocks, got {' '.join(map(str, runs))}",
                         "assign contiguous chunks: layer[0] -> pipe 0, layer[1] -> pipe 1, ...")
            return
        for i in range(len(seq) - 1):
            if seq[i] > seq[i + 1]:
                self.err(self.stage_locs[i + 1], f"block {self.m.blocks[i + 1]} is on stage "
                         f"{seq[i + 1]}, before the stage {seq[i]} of {self.m.blocks[i]}",
                         "stages must follow block order (block i's stage <= block i+1's)")
                return

    def schedule(self, s: ast.ScheduleStmt, sample, pipe_axis, batch, operator) -> Schedule:
        kind = s.kind
        if kind not in SCHEDULES:
            self.err(s.kind_loc, f"unknown schedule '{kind}'",
                     did_you_mean(kind, SCHEDULES) or f"schedules: {', '.join(SCHEDULES)}")
            kind = "1f1b"
        opts: dict[str, int] = {}
        for key, value, loc in s.options:
            if key not in SCHEDULE_OPTIONS:
                self.err(loc, f"unknown schedule option '{key}'",
                         did_you_mean(key, SCHEDULE_OPTIONS) or "options: microbatches, chunks")
            elif key in opts:
                self.err(loc, f"schedule option '{key}' is given twice")
            elif value < 1:
                self.err(loc, f"{key} = {value}; it must be >= 1")
            else:
                opts[key] = value
        mb = opts.get("microbatches", 1)
        chunks = opts.get("chunks", 1)
        loc_of = {k: loc for k, _, loc in s.options}
        nstages = self.mesh.get(pipe_axis, 1) if pipe_axis else 1
        if batch is not None:
            replicas = self.mesh.get(sample[0][1], 1) if sample else 1
            per = self.dims[batch] // replicas
            if per % mb:
                ok = [n for n in range(1, per + 1) if per % n == 0]
                near = min(ok, key=lambda n: (abs(n - mb), n))
                self.err(loc_of.get("microbatches", s.loc),
                         f"microbatches = {mb} does not divide the per-replica batch "
                         f"{batch} / {replicas} = {per}", f"use microbatches = {near}")
        if kind == "interleaved":
            if chunks < 2:
                self.err(loc_of.get("chunks", s.kind_loc),
                         f"interleaved needs chunks >= 2 (got {chunks})",
                         "add: chunks = 2 (virtual stages per rank)")
            if mb % nstages:
                self.err(loc_of.get("microbatches", s.loc),
                         f"interleaved needs microbatches ({mb}) to be a multiple of the "
                         f"stage count ({nstages})")
        elif chunks != 1:
            self.err(loc_of["chunks"], f"chunks applies to the interleaved schedule, not {kind}")
        if operator:
            self.order_ok(kind == "interleaved", chunks, nstages, s.kind_loc)
        return Schedule(kind, mb, chunks)


def check_parallel(p: ast.ParallelDef, model: Model, sources: Sources):
    """Check one parallel block against its (checked) model: (ir.Parallel | None, diagnostics)."""
    c = _ParallelChecker(p, model, sources)
    par = c.check()
    if par is not None and not any(isinstance(s, ast.ScheduleStmt) for s in p.body):
        c.order_ok(False, 1, 1, None)  # order still matters without a schedule statement
        if c.diags:
            par = None
    return par, c.diags
