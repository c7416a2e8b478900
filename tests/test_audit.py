"""The step audit (jaxserve/audit.py) on programs whose traffic is known by hand, compiled for this CPU: a loop's
body counted once per trip, a layer of a carried stack read in place, conditionals, copies and donated pools."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxserve.audit import audit, donated_shapes

L, D, B = 6, 256, 8


def _scan(with_cond: bool):
    def f(x, ws):
        def body(h, w):
            y = h @ w
            if with_cond:
                y = jax.lax.cond(y[0, 0] > 0, lambda y: y * 2, lambda y: y - 1, y)
            return y, None

        return jax.lax.scan(body, x, ws)[0]

    x = jax.ShapeDtypeStruct((B, D), jnp.float32)
    ws = jax.ShapeDtypeStruct((L, D, D), jnp.float32)
    return jax.jit(f).lower(x, ws).compile().as_text()


def test_a_layer_scan_counts_every_trip_and_each_layer_once():
    a = audit(_scan(False), kv_shapes=())
    assert a.whiles == 1 and a.unknown_trips == 0 and a.conditionals == 0
    weights = L * D * D * 4
    # each trip reads its layer (XLA:CPU copies the scan's slice first: a copy read and written, then the product
    # reads the copy) and B rows in and out: between the layers read once and four times that
    assert weights < a.bytes < 4 * weights + L * 4 * B * D * 4, a.summary()


def test_conditionals_are_counted_per_trip_with_the_dearest_branch():
    a = audit(_scan(True), kv_shapes=())
    assert a.conditionals == L and a.whiles == 1, a
    assert a.bytes > audit(_scan(False), kv_shapes=()).bytes


def test_donated_arrays_are_the_pool_and_leave_the_bytes():
    pool = jax.ShapeDtypeStruct((4, 1024, 64), jnp.float32)
    rows = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    step = jax.jit(lambda pool, rows: pool.at[0, :8].set(rows), donate_argnums=0)
    text = step.lower(pool, rows).compile().as_text()
    assert donated_shapes(text) == {(4, 1024, 64)}
    priced = audit(text, kv_shapes=())  # priced as arrays: the whole pool in and out
    left = audit(text)  # the pool left out (the caller prices its KV): the rows written are what is left
    assert priced.bytes >= 2 * 4 * 1024 * 64 * 4 and left.bytes == pytest.approx(8 * 64 * 4, rel=0.01)
