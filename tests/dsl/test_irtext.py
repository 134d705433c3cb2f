"""`format_parallel`, the parallel block as `soapstone show` prints it: every statement that was
written (branches too) and the schedule that runs, nothing the block does not have."""

from __future__ import annotations

import textwrap

from soapstone.dsl import format_parallel, load

MODEL = """
model towers {
  dim batch = 8, features = 16, hidden = 32, ffn = 64, classes = 8
  input x : f32[batch, features]
  input y : i64[batch]
  h = relu(linear(x, features -> hidden))
  repeat 4 as layer {
    h = h + mlp(layernorm(h), ffn, activation = gelu)
  }
  a = mlp(h, ffn, activation = gelu)
  b = mlp(layernorm(h), ffn, activation = relu)
  logits = linear(a + b, hidden -> classes)
  output loss = cross_entropy(logits, y)
}
"""


def shown(block: str) -> str:
    """format_parallel of the one parallel block `block`, written after MODEL."""
    spec = load(MODEL + textwrap.dedent(block))
    (name,) = spec.parallels
    return format_parallel(spec.parallel(name))


def lines(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def test_a_block_without_schedule_or_zero_prints_neither():
    assert shown("""
        parallel dp2 for towers on mesh(data = 2) {
          sample batch -> data
        }
    """) == lines("""
        parallel dp2 for towers on mesh(data = 2)  # 2 ranks
          sample    batch -> data
    """)


def test_branch_statements_are_printed_as_written():
    assert shown("""
        parallel dp2br2 for towers on mesh(data = 2, branch = 2) {
          sample   batch -> data
          operator a -> branch 0, b -> branch 1
        }
    """) == lines("""
        parallel dp2br2 for towers on mesh(data = 2, branch = 2)  # 4 ranks
          sample    batch -> data
          operator  a -> branch 0
                    b -> branch 1
    """)


def test_stages_print_the_schedule_that_runs_even_when_none_is_written():
    assert shown("""
        parallel pp2 for towers on mesh(pipe = 2) {
          operator layer[0..1] -> pipe 0, layer[2..3] -> pipe 1
        }
    """) == lines("""
        parallel pp2 for towers on mesh(pipe = 2)  # 2 ranks
          operator  layer.0, layer.1 -> pipe 0
                    layer.2, layer.3 -> pipe 1
          schedule  1f1b, microbatches = 1
    """)


def test_a_written_schedule_and_zero_are_printed():
    assert shown("""
        parallel acc for towers on mesh(data = 2) {
          sample   batch -> data
          schedule gpipe, microbatches = 2
          zero     2
        }
    """) == lines("""
        parallel acc for towers on mesh(data = 2)  # 2 ranks
          sample    batch -> data
          schedule  gpipe, microbatches = 2
          zero      2
    """)


def test_a_written_default_schedule_is_printed_and_runs_as_none():
    written = """
        parallel dp2 for towers on mesh(data = 2) {
          sample   batch -> data
          schedule 1f1b, microbatches = 1
        }
    """
    assert shown(written).endswith("  schedule  1f1b, microbatches = 1\n")
    plain = load(MODEL + "parallel dp2 for towers on mesh(data = 2) { sample batch -> data }")
    assert load(MODEL + textwrap.dedent(written)).parallel("dp2") == plain.parallel("dp2")


def test_chunks_are_printed_for_the_interleaved_schedule():
    assert shown("""
        parallel inter for towers on mesh(pipe = 2) {
          operator layer[0] -> pipe 0, layer[1] -> pipe 1, layer[2] -> pipe 0, layer[3] -> pipe 1
          schedule interleaved, microbatches = 2, chunks = 2
        }
    """).endswith("  schedule  interleaved, microbatches = 2, chunks = 2\n")
