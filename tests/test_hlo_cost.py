"""hlo_cost: FLOPs and bytes read from HLO text, loop bodies counted by their trip counts (closed formulas)."""

import jax
import jax.numpy as jnp
import pytest

from dsv41 import hlo_cost


def _scan_of_matmuls(b, d, layers):
    def f(x, w):
        def body(c, wi):
            return jnp.tanh(c @ wi), None
        y, _ = jax.lax.scan(body, x, w)
        return jnp.einsum("bd,ed->be", y, y)
    return jax.jit(f).lower(jax.ShapeDtypeStruct((b, d), jnp.float32),
                            jax.ShapeDtypeStruct((layers, d, d), jnp.float32))


@pytest.mark.parametrize("compiled", [False, True])
def test_dot_flops_count_every_trip_of_a_loop(compiled):
    b, d, layers = 4, 16, 5
    lowered = _scan_of_matmuls(b, d, layers)
    text = lowered.compile().as_text() if compiled else lowered.as_text(dialect="hlo")
    program = hlo_cost.Program(text)
    assert program.unknown_trip_counts == 0
    assert program.totals()["flops"] == layers * 2 * b * d * d + 2 * b * b * d
    # XLA's own count takes the loop body once.
    if compiled:
        assert lowered.compile().cost_analysis()["flops"] < layers * 2 * b * d * d


def test_an_in_place_update_counts_its_row_not_the_buffer():
    def f(buf, row, i):
        return jax.lax.dynamic_update_slice(buf, row, (i, 0))
    lowered = jax.jit(f, donate_argnums=0).lower(jax.ShapeDtypeStruct((1024, 256), jnp.float32),
                                                 jax.ShapeDtypeStruct((1, 256), jnp.float32),
                                                 jax.ShapeDtypeStruct((), jnp.int32))
    program = hlo_cost.Program(lowered.compile().as_text())
    # The row read and written; the index scalars; never the 1 MiB buffer.
    assert 2 * 256 * 4 <= program.totals()["bytes"] < 4 * 256 * 4


def test_an_asynchronous_slice_into_on_chip_memory_is_counted_where_it_is_read():
    """A TPU prefetches a weight in 4 MiB `slice-start`s into on-chip memory (S(1)); each slice is read once by
    its consumer, never the whole 80 MiB operand per slice (as the libtpu v6e decode does: 40 of them)."""
    hlo = "\n".join([
        "%mul (p0: s8[4194304]) -> s8[4194304] {",
        "  %p0 = s8[4194304]{0} parameter(0)",
        "  ROOT %m = s8[4194304]{0} multiply(%p0, %p0)",
        "}",
        "ENTRY %main (w: s8[83886080]) -> s8[4194304] {",
        "  %w = s8[83886080]{0:T(1024)} parameter(0)",
        "  %ss = ((s8[83886080]{0:T(1024)}), s8[4194304]{0:T(1024)S(1)}, s32[]{:S(2)}) slice-start(%w), "
        "slice={[0:4194304]}",
        "  %sd = s8[4194304]{0:T(1024)S(1)} slice-done(%ss)",
        "  ROOT %f = s8[4194304]{0} fusion(%sd), kind=kLoop, calls=%mul",
        "}",
    ])
    assert hlo_cost.Program(hlo).totals()["bytes"] == 2 * 4194304   # the slice read, the product written


def test_a_conditional_counts_its_costliest_branch_once():
    def f(x, w, k):
        return jax.lax.switch(k, [lambda: x @ w, lambda: (x @ w) @ w, lambda: x], )
    lowered = jax.jit(f).lower(jax.ShapeDtypeStruct((8, 32), jnp.float32),
                               jax.ShapeDtypeStruct((32, 32), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    assert hlo_cost.dot_flops(lowered.as_text(dialect="hlo")) == 2 * (2 * 8 * 32 * 32)


def test_shape_bytes_follow_the_element_types():
    assert hlo_cost.shape_bytes("f32[4,8]{1,0}") == 128
    assert hlo_cost.shape_bytes("(bf16[2,3], f8e4m3fn[10], s4[6], pred[])") == 12 + 10 + 3 + 1
    with pytest.raises(ValueError, match="HLO element type: 'q7'"):
        hlo_cost.shape_bytes("q7[3]")


def test_a_batched_matmul_written_as_a_dilated_convolution_counts_one_tap():
    # TPU's form of einsum("gnd,gdi->gni") over G=6 groups: a window of G taps of which one meets data.
    text = """HloModule m

ENTRY %main (a: bf16[6,4,16], b: bf16[6,16,8]) -> f32[6,4,8] {
  %a = bf16[6,4,16]{2,1,0} parameter(0)
  %b = bf16[6,16,8]{2,1,0} parameter(1)
  ROOT %c = f32[6,4,8]{2,1,0} convolution(%a, %b), window={size=6 stride=5 lhs_dilate=6}, dim_labels=0bf_0io->0bf
}
"""
    assert hlo_cost.dot_flops(text) == 2 * 6 * 4 * 8 * 16
    # An output dimension written as a window of 5 taps over one input position padded by 4 on each side:
    # each output element meets that one position.
    widen = """HloModule m

ENTRY %main (a: bf16[4,1,16], b: bf16[5,16,8]) -> f32[4,5,8] {
  %a = bf16[4,1,16]{2,1,0} parameter(0)
  %b = bf16[5,16,8]{2,1,0} parameter(1)
  ROOT %c = f32[4,5,8]{2,1,0} convolution(%a, %b), window={size=5 pad=4_4 rhs_reversal=1}, dim_labels=b0f_0io->b0f
}
"""
    assert hlo_cost.dot_flops(widen) == 2 * 4 * 5 * 8 * 16
    # An ordinary convolution: every tap of a 3-wide window.
    plain = text.replace("window={size=6 stride=5 lhs_dilate=6}", "window={size=3}")
    assert hlo_cost.dot_flops(plain) == 2 * 6 * 4 * 8 * 16 * 3


def test_breakdown_groups_by_named_scope():
    def f(x, w):
        with jax.named_scope("attention"):
            y = x @ w
        with jax.named_scope("moe"):
            return (y @ w) @ w
    lowered = jax.jit(f).lower(jax.ShapeDtypeStruct((8, 32), jnp.float32), jax.ShapeDtypeStruct((32, 32), jnp.float32))
    b = hlo_cost.breakdown(hlo_cost.Program(lowered.compile().as_text()))
    flops = {r["scope"]: r["flops"] for r in b["by_scope"]}
    assert flops["attention"] == 2 * 8 * 32 * 32 and flops["moe"] == 2 * (2 * 8 * 32 * 32)
