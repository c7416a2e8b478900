"""A step's host arrays in one buffer: one host-to-device transfer a step instead of one per array.

A step takes some twenty small host arrays (tokens, positions, the page table, the sampler's per-row parameters, ...).
Passed to a jitted function one by one, each is its own transfer (on a GPU a copy and a synchronization each, on a
TPU a transfer each), all before the step can start. ``pack`` lays every numpy leaf of the step's host inputs into
one int32 buffer (32-bit types bit for bit, narrower ones widened) and keeps where each lies in the pytree's static
part; ``unpack``, inside the step, slices them back out (slices the compiler fuses into their readers). Leaves that
are already device arrays (the sampler's wide constants, placed once) pass through untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# (offset, shape, dtype) of a leaf in the buffer, or an int: its index among the device leaves passed beside it
Layout = tuple[jax.tree_util.PyTreeDef, tuple]


@jax.tree_util.register_pytree_node_class
class Packed:
    """A pytree of host arrays as one int32 buffer (``buffer``), with the device arrays that were among its leaves
    (``on_device``); the tree's structure and every leaf's place are static (``layout``: one trace per layout, as
    one per shape)."""

    def __init__(self, buffer, on_device: tuple, layout: Layout):
        self.buffer, self.on_device, self.layout = buffer, tuple(on_device), layout

    def tree_flatten(self):
        return (self.buffer, *self.on_device), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(children[0], children[1:], layout)


def _is_host(x) -> bool:
    return isinstance(x, np.ndarray | np.generic)


def pack(tree) -> Packed:
    """Every numpy leaf of ``tree`` in one int32 buffer; other leaves (device arrays, abstract ones) kept beside.

    Dtypes are those JAX would have given the arrays (64-bit ones narrowed unless x64 is on, as ``jnp.asarray`` does).
    """
    leaves, treedef = jax.tree.flatten(tree)
    parts, places, on_device, offset = [], [], [], 0
    for leaf in leaves:
        if not _is_host(leaf):
            places.append(len(on_device))
            on_device.append(leaf)
            continue
        x = np.asarray(leaf)
        dtype = np.dtype(jax.dtypes.canonicalize_dtype(x.dtype))
        if dtype.itemsize > 4:
            raise TypeError(f"pack: a {dtype} host array cannot go in a 32-bit buffer (shape {x.shape})")
        x = np.asarray(x, dtype, order="C")
        words = x.view(np.int32) if dtype.itemsize == 4 else x.astype(np.int32)
        parts.append(words.reshape(-1))
        places.append((offset, x.shape, dtype.str))
        offset += x.size
    buffer = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return Packed(buffer, tuple(on_device), (treedef, tuple(places)))


def unpack(packed):
    """The tree ``pack`` was given, inside a traced function: each host leaf a slice of the buffer (bit for bit). A
    tree that was not packed is returned as it is."""
    if not isinstance(packed, Packed):
        return packed
    treedef, places = packed.layout
    leaves = []
    for place in places:
        if isinstance(place, int):
            leaves.append(packed.on_device[place])
            continue
        offset, shape, dtype = place
        dtype = np.dtype(dtype)
        words = packed.buffer[offset : offset + int(np.prod(shape, dtype=np.int64))]
        if dtype.itemsize == 4:
            x = jax.lax.bitcast_convert_type(words, dtype)
        elif dtype == np.bool_:
            x = words != 0
        else:
            x = words.astype(dtype)
        leaves.append(jnp.reshape(x, shape))
    return jax.tree.unflatten(treedef, leaves)
