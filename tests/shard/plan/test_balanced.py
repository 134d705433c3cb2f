"""Load-balanced (zigzag) sequence splits: which positions each rank holds, the permutation a
gather undoes, the key prefixes each rank attends, and the compiled layout that asks for it.
The runs themselves reproduce one rank: tests/shard/runtime/numerics_cases.py (cp2b cases)."""

from __future__ import annotations

import pytest

from soapstone.shard.plan.balanced import (
    causal_prefix_work,
    local_positions,
    nested_runs,
    rank_runs,
    unzigzag,
    zigzag,
)


def test_rank_r_holds_chunks_r_and_2n_minus_1_minus_r():
    """seq 16 over 2 ranks: chunks of 4, rank 0 holds 0 and 3, rank 1 holds 1 and 2."""
    assert local_positions(16, 2, 0) == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 2, 1) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert zigzag(8, 4) == [0, 7, 1, 6, 2, 5, 3, 4]


@pytest.mark.parametrize("size,parts", [(16, 2), (24, 3), (64, 4), (16, 8)])
def test_the_pieces_cover_the_sequence_once_and_the_gather_is_undone(size, parts):
    order = zigzag(size, parts)
    assert sorted(order) == list(range(size))
    back = unzigzag(size, parts)
    assert [order[i] for i in back] == list(range(size))  # gathered pieces -> natural order
    for r in range(parts):
        held = rank_runs(size, parts, r, balanced=True)
        assert [p for _, first, n in held for p in range(first, first + n)] == \
            local_positions(size, parts, r)
        assert [at for at, _, _ in held] == [0, size // (2 * parts)]  # each chunk its own


def test_sequence_parallel_cuts_a_ranks_concatenated_chunks():
    """seq 12 over cp 2 balanced, then over model 3: rank 0 holds 0-2 and 9-11, in that local
    order; model piece 1 of it is positions 2 and 9, two runs of one (it straddles the
    chunks), each indexed from the piece's start."""
    assert nested_runs(12, 2, 0, True, 1, 3) == [(0, 2, 1), (1, 9, 1)]
    assert nested_runs(12, 2, 1, True, 2, 3) == [(0, 7, 2)]
    assert nested_runs(12, 2, 1, False, 2, 3) == [(0, 10, 2)]  # contiguous: one run


@pytest.mark.parametrize("size,parts,pieces", [(16, 2, 2), (12, 2, 3), (48, 3, 4), (64, 4, 8)])
def test_nested_pieces_are_contiguous_slices_of_the_local_order(size, parts, pieces):
    for r in range(parts):
        held = local_positions(size, parts, r)
        n = len(held) // pieces
        for k in range(pieces):
            runs = nested_runs(size, parts, r, True, k, pieces)
            assert [p for _, first, m in runs for p in range(first, first + m)] == \
                held[k * n:(k + 1) * n]
            assert sum(m for _, _, m in runs) == n and runs[0][0] == 0


@pytest.mark.parametrize("size,parts", [(16, 2), (64, 4), (96, 3)])
def test_every_rank_sees_as_many_keys(size, parts):
    """Under a causal mask a query at p sees p + 1 keys: balanced ranks see equally many, and
    attend key prefixes of (2n + 1) c^2 pairs (c = size / 2n), about half the dense square;
    contiguous ranks do not (the last sees most)."""
    c = size // (2 * parts)
    seen = [sum(p + 1 for p in local_positions(size, parts, r)) for r in range(parts)]
    assert len(set(seen)) == 1
    work = [causal_prefix_work(rank_runs(size, parts, r, True), size) for r in range(parts)]
    assert work == [pytest.approx((2 * parts + 1) * c * c / (2 * c * size))] * parts
    plain = [causal_prefix_work(rank_runs(size, parts, r, False), size) for r in range(parts)]
    assert plain == [pytest.approx((r + 1) / parts) for r in range(parts)]


def test_the_layout_compiles_balanced_sequence_and_keys():
    """`attribute seq -> cp balanced` marks seq and its rename seq_k; `show` and the
    parallel block's text say so, and the text loads back the same."""
    from soapstone.dsl import load
    from soapstone.dsl.compile.lower import lower
    from soapstone.dsl.model.irtext import format_parallel

    spec = load("examples/gpt.par")
    par = spec.parallel("cp2b")
    assert par.balanced == ("seq",) and spec.parallel("cp2").balanced == ()
    program = lower(spec.model(), par)
    assert program.balanced == ("seq", "seq_k")
    assert program.value("tokens").local_shape == (8, 8)
    text = format_parallel(par, source=True)
    assert "attribute seq -> cp balanced" in text
    assert text.count("balanced") == 1


def test_sequence_parallel_inside_balanced_cp_compiles_and_prints_back():
    """`attribute seq -> cp balanced` then `seq -> model`: the tokens cut over both (each cp
    rank's zigzag pair, halved over model); the text marks only the cp split balanced, so it
    loads back the same."""
    from soapstone.dsl import load
    from soapstone.dsl.compile.lower import lower
    from soapstone.dsl.model.irtext import format_parallel

    spec = load("examples/llama.par")
    par = spec.parallel("cp2bsp2")
    program = lower(spec.model(), par)
    assert program.balanced == ("seq", "seq_k")
    assert program.value("tokens").layout.dim_axes("seq") == ("cp", "model")
    assert program.value("tokens").local_shape == (8, 4)
    assert "attribute seq -> cp balanced, seq -> model\n" in format_parallel(par, source=True)
