"""A llama.cpp sequence state cut into per-block KV payloads, and payloads joined back into a state.

The tiered KV store (`dynamo_cli.kv.tiers`) keeps one payload per full block. A block's payload is its
`block_size` cells, in position order, over every layer (the state's layout, `kv_state`, minus the cell
records, which `join` rebuilds):

    per layer: K rows (block_size x k row bytes)
    per layer: V rows (block_size x v row bytes), or with V transposed: n_embd_v x block_size elements

`split` reads an exported state (the cells may sit in any order in llama.cpp's cache: they are sorted
by position first); `join` writes a state of positions 0..n-1 for one sequence, which the caller then
passes through `kv_state.check` like any state from outside. Both are pure and run off the step loop.
Only models whose cells carry no ext record (M-RoPE) are supported (`supports`).
"""

from __future__ import annotations

import struct

import numpy as np

from .kv_state import MAGIC, StateFormatError, StateLayout

_HEADER = struct.Struct("<IiI")
_CELL = struct.Struct("<iIi")
_LAYER_HEADER = struct.Struct("<iQ")
_V_TRANS_HEADER = struct.Struct("<iII")


def supports(layout: StateLayout) -> bool:
    """Whether states of this layout can be cut into blocks (cells without an ext record)."""
    return layout.ext_size == 0


def block_bytes(layout: StateLayout, block_size: int) -> int:
    """Bytes of one block's payload."""
    return layout.cell_bytes() * block_size


def split(blob: bytes, layout: StateLayout, block_size: int, blocks: list[int]) -> list[bytes]:
    """The payloads of blocks `blocks` (indices from position 0) of an exported, `kv_state.check`ed state."""
    count, offset = _find_cells(blob)
    positions = np.frombuffer(blob, dtype=np.int32, count=3 * count, offset=offset)[0::3]
    order = np.argsort(positions, kind="stable")
    offset += count * _CELL.size + 8  # cells, then v_trans and n_layer
    layers: list[np.ndarray] = []
    for _, row in layout.k_layers:
        offset += _LAYER_HEADER.size
        layers.append(np.frombuffer(blob, np.uint8, count * row, offset).reshape(count, row)[order])
        offset += count * row
    for _, size, n_embd in layout.v_layers:
        offset += _V_TRANS_HEADER.size if layout.v_trans else _LAYER_HEADER.size
        if layout.v_trans:
            data = np.frombuffer(blob, np.uint8, n_embd * count * size, offset).reshape(n_embd, count, size)
            layers.append(data[:, order, :])
            offset += n_embd * count * size
        else:
            layers.append(np.frombuffer(blob, np.uint8, count * size, offset).reshape(count, size)[order])
            offset += count * size
    n_k = len(layout.k_layers)
    out = []
    for b in blocks:
        cells = slice(b * block_size, (b + 1) * block_size)
        parts = [layer[:, cells, :] if i >= n_k and layout.v_trans else layer[cells] for i, layer in enumerate(layers)]
        out.append(b"".join(np.ascontiguousarray(p).tobytes() for p in parts))
    return out


def join(payloads: list[bytes], layout: StateLayout, block_size: int, seq_id: int = 0) -> bytes:
    """A sequence state of positions 0..len(payloads) x block_size - 1 in `seq_id`, from block payloads
    (StateFormatError if one has the wrong size)."""
    size = block_bytes(layout, block_size)
    for i, payload in enumerate(payloads):
        if len(payload) != size:
            raise StateFormatError(f"block {i}'s payload has {len(payload)} bytes; a block here has {size}")
    count = len(payloads) * block_size
    views = [np.frombuffer(p, np.uint8) for p in payloads]
    parts: list[bytes] = [_HEADER.pack(MAGIC, seq_id, 1), struct.pack("<I", count)]
    cells = np.zeros((count, 3), dtype=np.int32)
    cells[:, 0], cells[:, 1], cells[:, 2] = np.arange(count), 1, seq_id
    parts += [cells.tobytes(), struct.pack("<II", layout.v_trans, len(layout.k_layers))]
    offset = 0
    for ggml_type, row in layout.k_layers:
        n = block_size * row
        parts += [_LAYER_HEADER.pack(ggml_type, row), *(v[offset : offset + n].tobytes() for v in views)]
        offset += n
    for ggml_type, el, n_embd in layout.v_layers:
        if layout.v_trans:
            n = n_embd * block_size * el
            blocks = [v[offset : offset + n].reshape(n_embd, block_size * el) for v in views]
            parts += [_V_TRANS_HEADER.pack(ggml_type, el, n_embd), np.concatenate(blocks, axis=1).tobytes()]
        else:
            n = block_size * el
            parts += [_LAYER_HEADER.pack(ggml_type, el), *(v[offset : offset + n].tobytes() for v in views)]
        offset += n
    return b"".join(parts)


def _find_cells(blob: bytes) -> tuple[int, int]:
    """(cell count, offset of the first cell record) of the one stream with cells."""
    _, _, n_stream = _HEADER.unpack_from(blob, 0)
    offset = _HEADER.size
    for _ in range(n_stream):
        (count,) = struct.unpack_from("<I", blob, offset)
        offset += 4
        if count:
            return count, offset
    raise StateFormatError("the state holds no cells")
