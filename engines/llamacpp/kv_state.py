"""llama.cpp's sequence-state format, parsed and checked in Python before any of it reaches C.

`llama_state_seq_get_data` writes (llama-context.cpp `state_seq_get_data`, llama-kv-cache.cpp
`state_write`, `state_write_meta`, `state_write_data`; llama-cpp-python 0.3.36), little-endian:

    u32 magic 0xaf143cd8, i32 source seq id, u32 n_stream
    per stream: u32 cell_count; when > 0:
        per cell: i32 pos, u32 n_seq_id, [cell ext: M-RoPE x, y and token, 12 bytes, some models only],
                  i32 seq id x n_seq_id
        u32 v_trans, u32 n_layer
        per layer: i32 k type, u64 k row size, cell_count rows
        per layer with V, v_trans 0: i32 v type, u64 v row size, cell_count rows
                          v_trans 1: i32 v type, u32 element size, u32 n_embd_v, n_embd_v x cell_count elements

llama.cpp reads it back trusting much of it (a bad position or seq id count can trip a GGML_ASSERT and
abort the process), so a state from another worker is checked here, field by field, against the layout
this engine's own export has (`StateLayout.learn`, from a probe sequence at start): one stream with
cells, each cell one seq id, positions exactly 0..num_tokens-1, the same layer count, tensor types and
row sizes, and the exact total size. `n_stream` may differ (one per sequence id with kv_unified off, so
it follows max_num_seqs): `rebased` rewrites the stream header for this engine's count, because on import
llama.cpp puts the cells into the destination sequence's own stream whichever stream they came from.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = 0xAF143CD8
_HEADER = struct.Struct("<IiI")  # magic, seq id, n_stream
_U32 = struct.Struct("<I")
_LAYER_HEADER = struct.Struct("<iQ")  # type, row size
_V_TRANS_HEADER = struct.Struct("<iII")  # type, element size, n_embd_v
_EXT_SIZES = (0, 12)
"""Bytes of a cell's ext record: none, or llama_kv_cell_ext (x, y, token)."""


class StateFormatError(ValueError):
    """The bytes are not a sequence state this engine can import; the message says which field."""


@dataclass(frozen=True, slots=True)
class StateLayout:
    """What this engine's own sequence states look like, learned from an export of a probe sequence."""

    n_stream: int
    """KV streams of this context (1 unified; one per sequence id otherwise)."""
    ext_size: int
    """Bytes of each cell's ext record (0 for most models)."""
    v_trans: int
    """1: V is stored transposed (flash attention off), 0: row per cell."""
    k_layers: tuple[tuple[int, int], ...]
    """(ggml type, row bytes) of K for each layer."""
    v_layers: tuple[tuple[int, int, int], ...]
    """(ggml type, row bytes or element bytes, n_embd_v or 0) of V for each layer that has one."""

    @classmethod
    def learn(cls, probe: bytes) -> StateLayout:
        """The layout of `probe`, an export of one sequence of this engine (every layer with a V)."""
        for ext_size in _EXT_SIZES:
            try:
                return _learn(probe, ext_size)
            except (StateFormatError, struct.error):
                continue
        raise StateFormatError("the probe state matches no known llama.cpp sequence-state layout")

    def cell_bytes(self) -> int:
        """Bytes one cell takes over every layer's K and V (the per-token size of a state)."""
        k = sum(row for _, row in self.k_layers)
        v = sum(size * (n_embd or 1) for _, size, n_embd in self.v_layers)
        return k + v


@dataclass(frozen=True, slots=True)
class CheckedState:
    """A state that passed `check`: its one stream's cells, ready to be rebased for this context."""

    blob: bytes
    seq_id: int
    """The source sequence id written in the header."""
    num_cells: int
    body_start: int
    """Offset of the first cell record (just after that stream's cell count)."""
    body_end: int
    """Offset just after that stream's data."""


def check(blob: bytes, layout: StateLayout, num_tokens: int, max_cells: int) -> CheckedState:
    """`blob` field by field against `layout`, for a sequence of `num_tokens` tokens in a stream of
    `max_cells` cells; StateFormatError naming the first field that is wrong."""
    if len(blob) < _HEADER.size:
        raise StateFormatError(f"the state has {len(blob)} bytes, fewer than its {_HEADER.size}-byte header")
    magic, seq_id, n_stream = _HEADER.unpack_from(blob, 0)
    if magic != MAGIC:
        raise StateFormatError(f"the state's magic is {magic:#x}, not llama.cpp's {MAGIC:#x}")
    if not 1 <= n_stream <= 4096 or len(blob) < _HEADER.size + 4 * n_stream:
        raise StateFormatError(f"the state's stream count {n_stream} does not fit its {len(blob)} bytes")
    if not 0 < num_tokens <= max_cells:
        raise StateFormatError(f"the state would hold {num_tokens} tokens; a sequence here holds 1..{max_cells}")
    offset, found = _HEADER.size, None
    for _ in range(n_stream):
        (count,) = _unpack(_U32, blob, offset, "a stream's cell count")
        offset += 4
        if count == 0:
            continue
        if found is not None:
            raise StateFormatError("the state has cells in two streams; a sequence lives in one")
        if count != num_tokens:
            raise StateFormatError(f"the state holds {count} cells, but kv_transfer covers {num_tokens} tokens")
        start = offset - 4
        offset = _check_cells(blob, offset, count, seq_id, layout)
        offset = _check_data(blob, offset, count, layout)
        found = (start, offset)
    if found is None:
        raise StateFormatError("the state holds no cells")
    if offset != len(blob):
        raise StateFormatError(f"the state has {len(blob) - offset} bytes past its end ({offset} expected)")
    return CheckedState(blob, seq_id, num_tokens, found[0], found[1])


def rebased(state: CheckedState, n_stream: int) -> list[bytes | memoryview]:
    """The parts of `state` as a context of `n_stream` streams reads it: the header, the one stream
    with cells (as stream 0), the other streams' zero cell counts. No copy of the tensors."""
    header = _HEADER.pack(MAGIC, state.seq_id, n_stream)
    return [header, memoryview(state.blob)[state.body_start : state.body_end], bytes(4 * (n_stream - 1))]


def _check_cells(blob: bytes, offset: int, count: int, seq_id: int, layout: StateLayout) -> int:
    record = struct.Struct(f"<iI{layout.ext_size}xi")
    end = offset + count * record.size
    if end > len(blob):
        raise StateFormatError(f"the state ends inside its cell list ({len(blob)} bytes, {end} needed)")
    positions = bytearray(count)
    for pos, n_seq_id, cell_seq in record.iter_unpack(memoryview(blob)[offset:end]):
        if n_seq_id != 1 or cell_seq != seq_id:
            raise StateFormatError(f"a cell has {n_seq_id} sequence ids (seq {cell_seq}); exactly one, {seq_id}")
        if not 0 <= pos < count or positions[pos]:
            raise StateFormatError(f"a cell's position {pos} repeats or is outside 0..{count - 1}")
        positions[pos] = 1
    return end


def _check_data(blob: bytes, offset: int, count: int, layout: StateLayout) -> int:
    v_trans, n_layer = _unpack(struct.Struct("<II"), blob, offset, "the layer header")
    if v_trans != layout.v_trans:
        raise StateFormatError(
            f"the state's V is {'' if v_trans else 'not '}transposed and this engine's is "
            f"{'' if layout.v_trans else 'not '}; run prefill and decode with the same deterministic setting"
        )
    if n_layer != len(layout.k_layers):
        raise StateFormatError(f"the state has {n_layer} layers; this model has {len(layout.k_layers)}")
    offset += 8
    for i, expected in enumerate(layout.k_layers):
        got = _unpack(_LAYER_HEADER, blob, offset, f"layer {i}'s K header")
        if got != expected:
            raise StateFormatError(f"layer {i}'s K is (type, row bytes) {got}; this engine's is {expected}")
        offset += _LAYER_HEADER.size + count * expected[1]
    header = _V_TRANS_HEADER if layout.v_trans else _LAYER_HEADER
    for i, v_expected in enumerate(layout.v_layers):
        expected_v = v_expected if layout.v_trans else v_expected[:2]
        got_v = _unpack(header, blob, offset, f"layer {i}'s V header")
        if got_v != expected_v:
            raise StateFormatError(f"layer {i}'s V header is {got_v}; this engine's is {expected_v}")
        offset += header.size + count * v_expected[1] * (v_expected[2] or 1)
    if offset > len(blob):
        raise StateFormatError(f"the state ends inside its tensors ({len(blob)} bytes, {offset} needed)")
    return offset


def _unpack(fmt: struct.Struct, blob: bytes, offset: int, what: str) -> tuple[int, ...]:
    if offset + fmt.size > len(blob):
        raise StateFormatError(f"the state ends before {what} (offset {offset} of {len(blob)} bytes)")
    return fmt.unpack_from(blob, offset)


def _learn(probe: bytes, ext_size: int) -> StateLayout:
    magic, seq_id, n_stream = _HEADER.unpack_from(probe, 0)
    if magic != MAGIC:
        raise StateFormatError(f"the probe state's magic is {magic:#x}")
    offset = _HEADER.size
    for _ in range(n_stream):
        (count,) = _U32.unpack_from(probe, offset)
        offset += 4
        if count:
            break
    offset += count * (12 + ext_size)
    v_trans, n_layer = struct.unpack_from("<II", probe, offset)
    offset += 8
    k_layers = []
    for _ in range(n_layer):
        k_layers.append(_LAYER_HEADER.unpack_from(probe, offset))
        offset += _LAYER_HEADER.size + count * k_layers[-1][1]
    v_layers: list[tuple[int, int, int]] = []
    for _ in range(n_layer):
        if v_trans:
            v_layers.append(_V_TRANS_HEADER.unpack_from(probe, offset))
        else:
            v_layers.append((*_LAYER_HEADER.unpack_from(probe, offset), 0))
        offset += (_V_TRANS_HEADER if v_trans else _LAYER_HEADER).size + count * v_layers[-1][1] * (
            v_layers[-1][2] or 1
        )
    layout = StateLayout(n_stream, ext_size, v_trans, tuple(k_layers), tuple(v_layers))
    check(probe, layout, count, count)  # the layout must read its own probe back, byte for byte
    return layout
