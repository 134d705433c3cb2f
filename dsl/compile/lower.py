"""Lowering: give every tensor a layout, insert the collectives, produce the Program.

Forward: params and inputs get layouts from the parallel block's statements; each op, in order,
picks per mesh axis the cheapest sharding its rules allow (`rules.py`), and every arg whose layout
differs is redistributed first (allreduce, reduce_scatter, allgather, local slice, all-to-all),
each redistribution computed once and reused.

Backward follows from one invariant: the gradient of a replicated value is replicated. Where a
replicated value feeds rank-varying work (an op whose output is split or partial on that axis), its
gradient arrives as per-rank terms; one `CopyTo` (Megatron's `f`: identity forward, allreduce
backward) restores the invariant, unless the value was just allgathered on that axis (then the
gather's backward becomes a reduce_scatter: sequence parallelism) or it is a parameter (then its
gradient is summed over that axis in the gradient sync: data parallelism). Model inputs are data
and carry no gradient, except those named in `grad_inputs` (tensors a pipeline stage receives,
whose gradients it sends back): those follow the invariant too."""

from __future__ import annotations

import math
from pathlib import Path

import attrs

from soapstone.dsl.compile import rules
from soapstone.dsl.lang.errors import Diagnostic, SpecError
from soapstone.dsl.model import ir
from soapstone.shard.ops.record import Partial, Role
from soapstone.shard.parallel.op_policy_plan import op_policy_drops
from soapstone.shard.parallel.regather_plan import regathered
from soapstone.shard.parallel.selective_plan import selective_drops
from soapstone.shard.plan.collectives import transition_cost
from soapstone.shard.plan.dtypes import is_float
from soapstone.shard.plan.layout import (
    Layout,
    Owned,
    P,
    Placement,
    R,
    RedistributeKind,
    Split,
    nbytes,
    token,
    transition,
)
from soapstone.shard.plan.program import (
    Compute,
    CopyTo,
    GradPlacement,
    InputRole,
    ParamSpec,
    Program,
    Redistribute,
    Step,
    Value,
)


class LoweringError(SpecError):
    """No valid sharding exists for an op under the chosen layout (a located spec error)."""

    @classmethod
    def at(cls, message: str, loc: ir.Loc | None, hint: str | None = None) -> LoweringError:
        """The error pointing at `loc` in its spec file, with the source line when readable."""
        if loc is None:
            return cls([Diagnostic("<model>", 0, 0, message, hint)])
        try:
            source = Path(loc.file).read_text().splitlines()[loc.line - 1]
        except (OSError, IndexError):
            source = None
        return cls([Diagnostic(loc.file, loc.line, loc.col, message, hint, source, loc.end_col)])


class _Reader:
    """A step's block is its reader's: the block of the op being lowered."""


_READER = _Reader()


@attrs.frozen
class _Candidate:
    args: tuple[Placement, ...]  # placement wanted for each arg, in the arg's own dim names
    out: Placement  # the output's placement
    dim: str | None  # the iteration dim split over the axis, if any
    stat: bool = False  # the op combines partial statistics over the axis
    exchange: str | None = None  # a second dim split over the axis, rows moved to it (rules)


def lower(model: ir.Model, parallel: ir.Parallel | None = None,
          grad_inputs: frozenset[str] = frozenset(),
          send: frozenset[str] = frozenset()) -> Program:
    """Compile a model under a parallel block (None: one rank) into a Program.

    Tied params are resolved first (`resolve_ties`). `grad_inputs` names the inputs whose
    gradients leave the program (a pipeline stage's received boundary tensors): backward
    treats them like any other value, so a replicated one feeding rank-varying work gets its
    `CopyTo`. Other inputs (data) carry no gradient. `send` names the outputs the next
    pipeline stage receives: each leaves in the layout that stage gives its inputs (a partial
    sum is reduced first, so a bias-free residual stream crosses as the next stage reads it).
    """
    if parallel is not None and parallel.operator:
        # A pipeline layout is one Program per stage: soapstone.dsl.compile.stages.lower_pipeline.
        raise LoweringError.at(
            f"parallel block '{parallel.name}' places blocks on pipeline stages: it compiles "
            "to a stage graph (one Program per stage), not one Program",
            parallel.loc, hint="call soapstone.dsl.compile.stages.lower_graph(model, parallel) "
            "and run it with soapstone.shard.runtime.executor.Executor")
    return _Lowering(resolve_ties(model), parallel, grad_inputs, send).run()


def resolve_ties(model: ir.Model) -> ir.Model:
    """The model with every `tied_to` param replaced by its target (the same dims required)."""
    ties = {p.name: p.tied_to for p in model.params if p.tied_to}
    if not ties:
        return model
    by_name = {p.name: p for p in model.params}
    for name, target in ties.items():
        if target not in by_name:
            raise LoweringError.at(f"param {name} is tied to unknown param {target}",
                                   by_name[name].loc)
        a, b = by_name[name].type, by_name[target].type
        # another dim order is fine: the `tie` statement checked that readers go by name
        if a.dtype != b.dtype or sorted(a.dims) != sorted(b.dims):
            raise LoweringError.at(
                f"param {name} {a.dims} is tied to {target} {b.dims}: tied params need the "
                "same dims", by_name[name].loc)
    ops = tuple(attrs.evolve(op, args=tuple(ties.get(a, a) for a in op.args))
                for op in model.ops)
    params = tuple(p for p in model.params if p.name not in ties)
    return attrs.evolve(model, params=params, ops=ops)


class _Lowering:
    def __init__(self, model: ir.Model, parallel: ir.Parallel | None,
                 grad_inputs: frozenset[str] = frozenset(), send: frozenset[str] = frozenset()):
        self.model = model
        self.grad_inputs = frozenset(grad_inputs)
        self.send = frozenset(send)
        self.par = parallel
        self.sizes = dict(model.dims)
        self.mesh = dict(parallel.mesh) if parallel else {}
        self.axes = tuple(a for a, _ in parallel.mesh) if parallel else ()
        # Only axes with more than one rank shard anything.
        self.active = tuple(a for a in self.axes if self.mesh[a] > 1)
        alias = dict(model.dim_alias)
        self.allowed: dict[str, set[str]] = {a: set() for a in self.axes}
        if parallel:
            for dim, axis in (*parallel.sample, *parallel.attribute, *parallel.parameter):
                self.allowed[axis].add(dim)
        for derived, base in alias.items():
            for dims in self.allowed.values():
                if base in dims:
                    dims.add(derived)
        branches = [b for b in (parallel.branches if parallel else ()) if b.axis in self.active]
        self.owner = branch_owners(model, branches)
        self.values: dict[str, Value] = {}
        self.params: dict[str, ir.Param] = {p.name: p for p in model.params}
        self.steps: list[Step] = []
        self.producer: dict[str, int] = {}
        self.cache: dict[tuple[str, str, Placement], str] = {}
        self.block: str | None = None  # the repeat block of the op being lowered
        # the op being lowered: each dim an earlier axis split as a plain FREE dim -> its
        # pieces so far (a later axis may cut each piece again: Layout's nesting)
        self.nest: dict[str, int] = {}
        self.step_block: list[str | None] = []  # each step's block

    # --- layouts of the leaves -------------------------------------------------------------

    def _leaf_layout(self, dims: tuple[str, ...], mapping: tuple[tuple[str, str], ...]) -> Layout:
        placement: dict[str, Placement] = {}
        for dim, axis in mapping:
            if dim in dims and axis in self.active and axis not in placement:
                placement[axis] = Split(dim)
        return Layout.of(self.axes, placement)

    def _add_value(self, name: str, dtype: str, dims: tuple[str, ...], layout: Layout) -> Value:
        shape = layout.local_sizes(dims, self.sizes, self.mesh)
        v = Value(name, dtype, dims, layout, shape)
        self.values[name] = v
        return v

    # --- the walk --------------------------------------------------------------------------

    def run(self) -> Program:
        """Lay out the leaves, lower every op in order, then restore the backward invariant."""
        par = self.par
        for inp in self.model.inputs:
            mapping = (*par.sample, *par.attribute) if par else ()
            self._add_value(inp.name, inp.type.dtype, inp.type.dims,
                            self._leaf_layout(inp.type.dims, mapping))
        for p in self.model.params:
            self._add_value(p.name, p.type.dtype, p.type.dims,
                            self._leaf_layout(p.type.dims, par.parameter if par else ()))
        for op in self.model.ops:
            self.block = op.block
            self._lower_op(op)
        self.block = None
        outputs = tuple(self._sent(o) if o.name in self.send else o
                        for o in self.model.outputs)
        grad_sync = self._backward()
        params = tuple(
            ParamSpec(
                name=p.name, dtype=p.type.dtype, dims=p.type.dims,
                shape=tuple(self.sizes[d] for d in p.type.dims), init=p.init,
                layout=self.values[p.name].layout,
                local_shape=self.values[p.name].local_shape,
                grad_sync=grad_sync.get(p.name, ()), block=p.block,
            )
            for p in self.model.params
        )
        program = Program(
            model=self.model.name,
            parallel=par.name if par else None,
            mesh=par.mesh if par else (),
            dims=self.model.dims,
            inputs=tuple(i.name for i in self.model.inputs),
            params=params,
            values=tuple(self.values.values()),
            steps=tuple(self.steps),
            outputs=outputs,
            batch_dim=batch_dim(self.model, par),
            data_axes=self._sample_axes(),
            zero_axes=self._zero_axes(params),
            zero=par.zero if par else 0,
            roles=input_roles(self.model),
            recompute=self._recompute_ranges(),
            offload=bool(par and par.offload), overlap_tensor=bool(par and par.overlap),
            balanced=tuple(r for d in (par.balanced if par else ()) for r in
                           self.model.renames_of(d)),
        )
        if self.par and self.par.recompute == ir.SELECTIVE:  # a rule over the compiled ops
            program = attrs.evolve(program, dropped=selective_drops(program),
                                   drop_rule="selective")
        elif self.par and self.par.recompute == ir.OPS:  # the same, per repeat block
            dropped, held = op_policy_drops(program, tuple(self.step_block))
            program = attrs.evolve(program, dropped=dropped, held=held, drop_rule="ops")
        # sequence parallelism keeps the linears' input shards, not the gathered inputs
        return attrs.evolve(program, regathered=regathered(program))

    def _sample_axes(self) -> tuple[str, ...]:
        """The sample axes that split something: gradients are summed there."""
        return tuple(dict.fromkeys(a for _, a in (self.par.sample if self.par else ())
                                   if a in self.active))

    def _zero_axes(self, params: tuple[ParamSpec, ...]) -> tuple[str, ...]:
        """What ZeRO shards over (Program.zero_axes): the sample axes, then each `attribute`
        axis (context parallel) on which no parameter is split; under sequence parallelism
        the tensor axis splits the matmul weights, so it is not one."""
        split = {a for p in params for a in p.layout.split_axes()}
        context = (a for _, a in (self.par.attribute if self.par else ())
                   if a in self.active and a not in split)
        return tuple(dict.fromkeys((*self._sample_axes(), *context)))

    def _recompute_ranges(self) -> tuple[tuple[int, int], ...]:
        """`recompute R`: each maximal run of steps lowered from one block of repeat R."""
        target = self.par.recompute if self.par else None
        if target in (ir.SELECTIVE, ir.OPS):
            return ()
        out: list[tuple[int, int]] = []
        for i, b in enumerate(self.step_block):
            if b is None or b.rsplit(".", 1)[0] != target:
                continue
            if out and out[-1][1] == i and self.step_block[i - 1] == b:
                out[-1] = (out[-1][0], i + 1)
            else:
                out.append((i, i + 1))
        return tuple(out)

    def _sent(self, out: ir.Output) -> ir.Output:
        """A boundary output redistributed to the layout the next stage reads it in."""
        v = self.values[out.value]
        mapping = (*self.par.sample, *self.par.attribute) if self.par else ()
        want = self._leaf_layout(v.dims, mapping)
        if v.layout == want:
            return out
        return attrs.evolve(out, value=self._redistribute(
            v.name, {a: want.get(a) for a in self.active}))

    def _lower_op(self, op: ir.Op) -> None:
        args = [self.values[a] for a in op.args]
        iter_dims = [rules.arg_dims(op, i, v.dims) for i, v in enumerate(args)]
        roles = rules.roles(op, iter_dims)
        wanted: list[dict[str, Placement]] = [{} for _ in args]
        out: dict[str, Placement] = {}
        dist: list[str] = []
        exchange: list[str] = []
        used: set[str] = set()
        self.nest = {}
        own = self.owner.get(op.out)
        for axis in self.active:
            if own is not None and own[0] == axis:
                # a branch op: only the owner computes it, from whole (or its own) args
                keep = [v.layout.get(axis) == Owned(own[1]) for v in args]
                best = _Candidate(tuple(v.layout.get(axis) if k else R
                                        for v, k in zip(args, keep, strict=True)),
                                  Owned(own[1]), None)
            else:
                best = self._choose(op, axis, args, iter_dims, roles, used)
            for i, placement in enumerate(best.args):
                wanted[i][axis] = placement
            out[axis] = best.out
            if best.dim:
                used.add(best.dim)
                if roles.get(best.dim) is rules.FREE and not best.exchange:
                    self.nest[best.dim] = self.nest.get(best.dim, 1) * self.mesh[axis]
            if best.stat:
                dist.append(axis)
            if best.exchange:
                used.add(best.exchange)
                exchange.append(axis)
        names = tuple(self._redistribute(v.name, w) for v, w in zip(args, wanted, strict=True))
        layout = Layout.of(self.axes, out)
        self._add_value(op.out, op.type.dtype, op.type.dims, layout)
        self._emit(Compute(
            out=op.out, kind=op.kind, args=names, attrs=op.attrs,
            arg_layouts=tuple(self.values[n].layout for n in names),
            dist=tuple(dist), source=op.out, owner=own, exchange=tuple(exchange),
        ))

    def _candidates(self, op: ir.Op, axis: str, args: list[Value],
                    iter_dims: list[tuple[str, ...]], roles: dict[str, Role],
                    used: set[str]) -> list[_Candidate]:
        out_dims = op.type.dims
        order = [d for d in out_dims if d in roles] + [d for d in roles if d not in out_dims]
        found = []
        for d in order:
            if not self._may_split(d, axis, used):
                continue
            splits = tuple(self._arg_split(op, axis, _split_of(dims, v.dims, d))
                           for dims, v in zip(iter_dims, args, strict=True))
            if None in splits:
                continue
            found.append(_Candidate(
                args=splits,
                out=Split(d) if d in out_dims else (P if roles[d] == rules.SUM else R),
                dim=d, stat=roles[d] == rules.STAT,
            ))
        for rows, owners in rules.exchange(op, iter_dims):
            if any(d in used or d not in self.allowed[axis] or self.sizes[d] % self.mesh[axis]
                   for d in (rows, owners)):
                continue
            found.append(_Candidate(
                args=tuple(_split_of(dims, v.dims, rows) if rows in dims
                           else _split_of(dims, v.dims, owners)
                           for dims, v in zip(iter_dims, args, strict=True)),
                out=Split(rows), dim=rows, stat=True, exchange=owners))
        mode = rules.partial_pass(op)
        if mode is Partial.ONE:
            for i in range(len(args)):
                found.append(_Candidate(tuple(P if j == i else R for j in range(len(args))), P,
                                        None))
        elif mode is Partial.ALL:
            found.append(_Candidate((P,) * len(args), P, None))
        found.append(_Candidate((R,) * len(args), R, None))
        return found

    def _may_split(self, d: str, axis: str, used: set[str]) -> bool:
        """Whether `axis` may split dim `d` of the op: mapped there, not split by an earlier
        axis except as a plain FREE dim (its pieces then cut again), and dividing."""
        if d not in self.allowed[axis] or (d in used and d not in self.nest):
            return False
        return not self.sizes[d] // self.nest.get(d, 1) % self.mesh[axis]

    def _arg_split(self, op: ir.Op, axis: str, want: Placement) -> Placement | None:
        """An arg's placement for a split of the op: None where its own dim does not divide
        over the axis (a repeat_dim's src: fewer kv heads than ranks), unless the op reads
        that arg whole by global index (rules.whole_arg)."""
        if isinstance(want, Split) and self.sizes[want.dim] % self.mesh[axis]:
            return R if rules.whole_arg(op) else None
        return want

    def _choose(self, op, axis, args, iter_dims, roles, used) -> _Candidate:
        best, best_cost = None, float("inf")
        # Candidates come splits first, so equal traffic keeps the smaller result.
        for cand in self._candidates(op, axis, args, iter_dims, roles, used):
            cost = sum(self._cost(v, axis, want) for v, want in zip(args, cand.args, strict=True))
            if cand.out == P and cand.dim is None:
                cost += self._deferred(op, axis, args, used)
            if cost < best_cost:
                best, best_cost = cand, cost
        if best is None:
            layouts = ", ".join(f"{v.name}: {v.layout}" for v in args)
            raise LoweringError.at(
                f"no valid sharding of {op.layer or op.kind} (producing {op.out}) over mesh "
                f"axis '{axis}': its args are laid out as {layouts}",
                op.loc,
                hint="parameters never move; map the dims of the parameters this op uses "
                "to the same axis, or leave them replicated",
            )
        return best

    def _deferred(self, op: ir.Op, axis: str, args: list[Value], used: set[str]) -> float:
        """The reduction a partial sum passed through `op` still owes: its output's cheapest,
        a reduce_scatter where a dim of it may split over the axis (sequence parallelism),
        else an allreduce. Passing a partial is then no cheaper than reducing the operands
        now, and where the reduction scatters, reducing now leaves the result (a bias-free
        residual stream) on shards, as Megatron's sequence parallelism keeps it."""
        split: dict[str, set[str]] = {}
        for v in args:
            for a, p in v.layout.placements:
                if a != axis and isinstance(p, Split):
                    split.setdefault(p.dim, set()).add(a)
        pieces = {d: math.prod(self.mesh[a] for a in axes) for d, axes in split.items()}
        shape = tuple(self.sizes[d] // pieces.get(d, 1) for d in op.type.dims)
        # a dim split on earlier axes as a plain FREE dim (self.nest) may be cut again
        scatter = any(self._may_split(d, axis, used) and (d not in split or d in self.nest)
                      for d in op.type.dims)
        kind = RedistributeKind.REDUCE_SCATTER if scatter else RedistributeKind.ALLREDUCE
        return transition_cost(kind, nbytes(op.type.dtype, shape), self.mesh[axis])

    def _cost(self, v: Value, axis: str, want: Placement) -> float:
        cur = v.layout.get(axis)
        if cur == want or (v.name, axis, want) in self.cache:
            return 0.0
        if v.layout.cuts_inside(self.axes, axis, cur) or v.layout.cuts_inside(
                self.axes, axis, want):
            return float("inf")  # not expressible: an outer cut moves under an inner one
        if v.name in self.params:
            return float("inf")  # parameters keep the layout the parallel block gave them
        kind = transition(cur, want)
        if kind is RedistributeKind.SLICE and v.is_float:
            # Free forward, but its backward is an allgather of the gradient.
            return transition_cost(RedistributeKind.ALLGATHER, v.nbytes // self.mesh[axis],
                                   self.mesh[axis])
        return transition_cost(kind, v.nbytes, self.mesh[axis])

    def _redistribute(self, name: str, wanted: dict[str, Placement]) -> str:
        v = self.values[name]
        # Gathers and reductions first, so a dim is free before another axis takes it; of a
        # dim split over several axes, the innermost cut is undone first (Layout's nesting).
        order = sorted(wanted, key=lambda a: (wanted[a] != R, transition(
            v.layout.get(a), wanted[a]) is RedistributeKind.ALLTOALL,
            v.layout.cuts_inside(self.axes, a, v.layout.get(a))))
        for axis in order:
            cur, want = v.layout.get(axis), wanted[axis]
            if cur == want:
                continue
            key = (v.name, axis, want)
            if key not in self.cache:
                kind = transition(cur, want)
                layout = v.layout.with_(self.axes, axis, want)
                new = self._add_value(f"{v.name}@{axis}:{token(want)}", v.dtype, v.dims,
                                      layout)
                self._emit(Redistribute(
                    out=new.name, src=v.name, axis=axis, kind=kind,
                    frm=cur, to=want,
                    nbytes=0 if kind in (RedistributeKind.SLICE, RedistributeKind.ZERO_FILL)
                    else v.nbytes,
                ), self._shrink_block(v.name, kind))
                self.cache[key] = new.name
            v = self.values[self.cache[key]]
        return v.name

    def _shrink_block(self, src: str, kind: RedistributeKind) -> str | None | _Reader:
        """The block a redistribution belongs to: its reader's, except a reduce_scatter right
        at the end of its source's block, which joins that block, so the boundary (what a
        recompute range keeps) holds the shard, not the partial sum (the embedding's)."""
        prod = self.producer.get(src)
        if (kind is RedistributeKind.REDUCE_SCATTER and prod is not None
                and self.step_block[-1] == self.step_block[prod]):
            return self.step_block[prod]
        return _READER

    def _emit(self, step: Step, block: str | None | _Reader = _READER) -> None:
        self.producer[step.out] = len(self.steps)
        self.steps.append(step)
        self.step_block.append(self.block if isinstance(block, _Reader) else block)

    # --- backward --------------------------------------------------------------------------

    def _backward(self) -> dict[str, tuple[str, ...]]:
        """Restore the invariant (see the module doc); return each param's grad-sync axes."""
        consumers: dict[str, list[int]] = {}
        for i, step in enumerate(self.steps):
            for a in _step_args(step):
                consumers.setdefault(a, []).append(i)
        # data inputs carry no gradient; received boundary tensors (grad_inputs) do
        inputs = {i.name for i in self.model.inputs} - self.grad_inputs
        grad_sync: dict[str, list[str]] = {}
        copies: dict[int, list[CopyTo]] = {}  # inserted before step i
        rewire: dict[tuple[int, str], str] = {}  # (step, old arg) -> new arg
        for name, v in list(self.values.items()):
            if not v.is_float or name in inputs or name not in consumers:
                continue
            for axis in self.active:
                if v.layout.get(axis) != R:
                    continue
                edges = consumers[name]
                varying = [i for i in edges if self._rank_varying(self.steps[i], axis)]
                if not varying:
                    continue
                every = len(varying) == len(edges)
                prod = self.producer.get(name)
                prod_step = self.steps[prod] if prod is not None else None
                if name in self.params and every:
                    grad_sync.setdefault(name, []).append(axis)
                elif (every and isinstance(prod_step, Redistribute)
                      and prod_step.kind is RedistributeKind.ALLGATHER
                      and prod_step.axis == axis):
                    self.steps[prod] = attrs.evolve(prod_step, grad=GradPlacement.PARTIAL)
                else:
                    # One copy per source: edges already behind another axis's copy keep it.
                    groups: dict[str, list[int]] = {}
                    for i in varying:
                        groups.setdefault(rewire.get((i, name), name), []).append(i)
                    for src, group in groups.items():
                        copy = CopyTo(out=f"{src}>copy:{axis}", src=src, axis=axis,
                                      nbytes=v.nbytes)
                        self.values[copy.out] = attrs.evolve(v, name=copy.out)
                        copies.setdefault(group[0], []).append(copy)
                        for i in group:
                            rewire[(i, name)] = copy.out
        steps: list[Step] = []
        blocks: list[str | None] = []
        for i, step in enumerate(self.steps):
            steps.extend(copies.get(i, []))
            steps.append(_with_args(step, [rewire.get((i, a), a) for a in _step_args(step)]))
            blocks += [self.step_block[i]] * (len(copies.get(i, [])) + 1)  # a copy: its reader's
        self.steps, self.step_block = steps, blocks
        return {k: tuple(a for a in self.axes if a in v) for k, v in grad_sync.items()}

    def _rank_varying(self, step: Step, axis: str) -> bool:
        """Whether a consumer of a replicated value computes different things on each rank."""
        if isinstance(step, Compute):
            return self.values[step.out].layout.get(axis) != R
        return False  # a slice's backward gathers; other-axis collectives keep R on this axis


def input_roles(model: ir.Model) -> tuple[InputRole, ...]:
    """Each input's role, read off the ops that use it: an embedding's ids (below the table's
    first dim), cross-entropy targets (below the class dim), else float data (or, for an
    integer input nothing classifies, labels of 2 classes)."""
    sizes = dict(model.dims)
    params = {p.name: p for p in model.params}
    found: dict[str, InputRole] = {}
    for op in model.ops:
        if op.kind == "embedding" and op.args[1] in params:
            ids = op.args[0]
            found.setdefault(ids, InputRole(ids, "ids", sizes[params[op.args[1]].type.dims[0]]))
        if op.kind == "cross_entropy":
            t = op.args[1]
            real = op.attr("classes")  # a padded class dim: targets are the real classes
            found.setdefault(t, InputRole(t, "labels", int(real) if real is not None
                                          else sizes[str(op.attr("over"))]))
    # the classified inputs in op order, then the rest in input order: the synthetic task
    # draws in this order, so it is part of what a recorded run reproduces
    inputs = {i.name for i in model.inputs}
    out = [r for r in found.values() if r.name in inputs]
    for i in model.inputs:
        if i.name not in found:
            out.append(InputRole(i.name, "float") if is_float(i.type.dtype)
                       else InputRole(i.name, "labels", 2))
    return tuple(out)


def batch_dim(model: ir.Model, parallel: ir.Parallel | None) -> str | None:
    """The dim microbatching cuts: the sample-mapped dim, else the first inputs' first dim
    (None: no input has dims)."""
    if parallel is not None and parallel.sample:
        return parallel.sample[0][0]
    return next((i.type.dims[0] for i in model.inputs if i.type.dims), None)


def branch_owners(model: ir.Model, branches) -> dict[str, tuple[str, int]]:
    """op output -> (axis, coord) for every op a branch owns: the op computing the branch's
    value, and every op whose results feed only ops the branch already owns."""
    consumers: dict[str, set[str]] = {}
    for op in model.ops:
        for a in op.args:
            consumers.setdefault(a, set()).add(op.out)
    outputs = {o.value for o in model.outputs}
    owner: dict[str, tuple[str, int]] = {}
    for b in branches:
        members = {b.value}
        for op in reversed(model.ops):
            used_by = consumers.get(op.out)
            if op.out not in members and used_by and used_by <= members \
                    and op.out not in outputs:
                members.add(op.out)
        for out in members:
            owner[out] = (b.axis, b.coord)
    return owner


def _split_of(iter_dims: tuple[str, ...], own_dims: tuple[str, ...], d: str) -> Placement:
    """The arg split along its own name for iteration dim `d` (replicated if it lacks it)."""
    for it, own in zip(iter_dims, own_dims, strict=True):
        if it == d:
            return Split(own)
    return R


def _step_args(step: Step) -> tuple[str, ...]:
    return step.args if isinstance(step, Compute) else (step.src,)


def _with_args(step: Step, args: list[str]) -> Step:
    if isinstance(step, Compute):
        return attrs.evolve(step, args=tuple(args))
    return attrs.evolve(step, src=args[0])
