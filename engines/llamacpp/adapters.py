"""LoRA adapter files for the llamacpp engine: checked with the gguf package before llama.cpp parses them,
and synthetic ones written for tests and benchmarks.

A LoRA GGUF (llama.cpp's `convert_lora_to_gguf.py`) says `general.type = "adapter"`, `adapter.type = "lora"`,
its base model's `general.architecture` and `adapter.lora.alpha`, and holds for each adapted weight W a pair
`W.lora_a`, `W.lora_b`; in gguf's ne order W is [n_in, n_out], lora_a [n_in, rank] and lora_b [rank, n_out]
(`token_embd.weight` [n_embd, n_vocab] the other way round: lora_a [rank, n_vocab], lora_b [rank, n_embd]),
and llama.cpp adds (alpha / rank) * B A x to W x. The path and its bytes come from a remote caller (the
worker's `lora` endpoint), and llama.cpp's parser aborts the whole process on some malformed files (a
metadata value of the wrong type, a token_embd pair whose ranks differ), so `check_adapter` reads the file
first, its header walked with struct (bounded counts; a model file refused in milliseconds), then the whole
of it with the gguf package, and refuses, as the caller's error, whatever llama.cpp would choke on.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dynamo_cli.errors import RequestError

MAX_ADAPTER_BYTES = 1 << 30
"""Largest adapter file taken (1 GiB: a rank-64 adapter of every projection of an 8B model is ~0.3 GiB)."""
MAX_METADATA = 256
"""Most metadata keys an adapter may have (converted ones have about 20)."""
LORA_TYPES = ("F32", "F16")
"""Tensor types taken for lora_a/lora_b (what llama.cpp's converter writes)."""
TARGETS = ("attn_q", "attn_v", "ffn_down")
"""`write_adapter`'s default: the weights its synthetic adapter changes, in every layer."""

_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count
_U32, _U64, _ARRAY_HEADER = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<IQ")
_STRING, _ARRAY = 8, 9  # gguf.GGUFValueType
_SUFFIXES = (".lora_a", ".lora_b")
_TOKEN_EMBD = "token_embd.weight"


@dataclass(frozen=True, slots=True)
class BaseTensors:
    """What an adapter must match in its base model: read once per model, then every adapter is checked
    against it."""

    architecture: str
    """`general.architecture` (llama, qwen2 ...)."""
    shapes: dict[str, tuple[int, ...]]
    """Tensor name -> its shape in gguf's ne order ([n_in, n_out] for a weight matrix)."""

    @classmethod
    def read(cls, model_path: str) -> BaseTensors:
        """The table of a GGUF model file (ValueError when it is not one)."""
        strings, shapes = _walk_header(model_path, max_metadata=None, max_tensors=None)
        return cls(architecture=strings.get("general.architecture", ""), shapes=shapes)


def check_adapter(path: str, model: str | BaseTensors) -> None:
    """Refuse (RequestError, param "lora_path", one line naming the problem) a file that is not a LoRA adapter
    of `model` (its GGUF path, or its table already read) in a form llama.cpp takes whole: a regular file of at
    most MAX_ADAPTER_BYTES with GGUF's magic, an adapter of type lora for the model's architecture, and only
    complete lora_a/lora_b pairs of F32/F16 matrices that fit weights the model has."""
    size = _checked_file(path)
    base = model if isinstance(model, BaseTensors) else BaseTensors.read(model)
    try:  # cheap first: a model file (a tokenizer of 100k strings) costs gguf.GGUFReader seconds
        strings, _ = _walk_header(path, max_metadata=MAX_METADATA, max_tensors=2 * len(base.shapes))
    except ValueError as exc:
        raise _refused(path, f"is not a GGUF file ({exc})") from None
    _check_strings(path, strings, base.architecture)
    reader = _read(path)
    _check_numbers(path, reader.fields)
    pairs = _pairs(path, reader, size)
    if not pairs:
        raise _refused(path, "holds no lora_a/lora_b tensors")
    for name, (a, b) in sorted(pairs.items()):
        _check_pair(path, name, a, b, base.shapes.get(name))


def write_adapter(
    path: str,
    model: str | BaseTensors,
    *,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    std: float = 0.05,
    targets: Sequence[str] = TARGETS,
) -> None:
    """A synthetic LoRA adapter of `model` (its GGUF path, or its table) at `path`: for every weight
    `blk.N.<target>.weight`, lora_a and lora_b drawn from N(0, std) by numpy's default_rng(seed), in F32. For
    tests and benchmarks: it changes the model's output visibly, and two seeds change it differently."""
    import gguf

    base = model if isinstance(model, BaseTensors) else BaseTensors.read(model)
    names = [n for n, shape in base.shapes.items() if len(shape) == 2 and _is_target(n, targets)]
    if not names:
        raise ValueError(f"the model has no blk.N.<target>.weight matrix for targets {list(targets)}")
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, base.architecture)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name in sorted(names):
        n_in, n_out = base.shapes[name]
        # numpy's shape is gguf's ne reversed: lora_a [n_in, rank] is a (rank, n_in) array.
        writer.add_tensor(f"{name}.lora_a", rng.normal(0.0, std, (rank, n_in)).astype(np.float32))
        writer.add_tensor(f"{name}.lora_b", rng.normal(0.0, std, (n_out, rank)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _is_target(name: str, targets: Sequence[str]) -> bool:
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in targets and parts[3] == "weight"


def _refused(path: str, problem: str) -> RequestError:
    return RequestError(f"LoRA adapter {path} {problem}", param="lora_path")


def _checked_file(path: str) -> int:
    """The size of the regular file at `path`."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise _refused(path, "does not exist; give the path of a GGUF adapter file on the worker's machine") from None
    except OSError as exc:
        raise _refused(path, f"cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise _refused(path, "is not a regular file")
    if info.st_size > MAX_ADAPTER_BYTES:
        raise _refused(path, f"is {info.st_size} bytes, over the {MAX_ADAPTER_BYTES}-byte limit for an adapter")
    return info.st_size


def _read(path: str) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - whatever the parser trips on, the file is at fault
        raise _refused(path, f"is not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def _check_strings(path: str, strings: dict[str, str], architecture: str) -> None:
    """The string metadata llama.cpp reads (`strings` holds string-typed values only: llama.cpp aborts on
    another type)."""
    if strings.get("general.type") != "adapter":
        raise _refused(path, "is not an adapter (general.type is not the string 'adapter'); is it a model file?")
    if strings.get("adapter.type") != "lora":
        raise _refused(path, "is not a LoRA adapter (adapter.type is not the string 'lora')")
    arch = strings.get("general.architecture")
    if arch != architecture:
        raise _refused(path, f"is for architecture {arch!r}, not the model's {architecture!r}")


def _check_numbers(path: str, fields: dict[str, Any]) -> None:
    import gguf

    alpha = fields.get(gguf.Keys.Adapter.LORA_ALPHA)
    if alpha is not None and (alpha.types != [gguf.GGUFValueType.FLOAT32] or not math.isfinite(alpha.contents())):
        raise _refused(path, "has an adapter.lora.alpha that is not a finite float32 (llama.cpp reads one)")
    if gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS in fields:
        raise _refused(path, "is an activated LoRA (adapter.alora.invocation_tokens), which is not supported")


def _pairs(path: str, reader: Any, size: int) -> dict[str, tuple[Any, Any]]:
    """Base tensor name -> its (lora_a, lora_b) tensors, each a 2-D F32/F16 tensor inside the file."""
    halves: dict[str, dict[str, Any]] = {}
    for tensor in reader.tensors:
        name = tensor.name
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            raise _refused(path, f"holds tensor {name}, which is neither a .lora_a nor a .lora_b")
        if tensor.tensor_type.name not in LORA_TYPES:
            raise _refused(path, f"holds {name} as {tensor.tensor_type.name}; only {'/'.join(LORA_TYPES)} are taken")
        if len(tensor.shape) != 2 or min(int(n) for n in tensor.shape) < 1:
            raise _refused(path, f"holds {name} of shape {_ne(tensor)}, not a matrix")
        if tensor.data_offset + tensor.n_bytes > size or tensor.data.nbytes != tensor.n_bytes:
            raise _refused(path, f"holds {name}, whose data runs past the end of the file")
        halves.setdefault(name.removesuffix(suffix), {})[suffix] = tensor
    for name, pair in halves.items():
        missing = next((s for s in _SUFFIXES if s not in pair), None)
        if missing is not None:
            raise _refused(path, f"holds half a pair: {name}{missing} is missing")
    return {name: (pair[".lora_a"], pair[".lora_b"]) for name, pair in halves.items()}


def _check_pair(path: str, name: str, a: Any, b: Any, base: tuple[int, ...] | None) -> None:
    """lora_a and lora_b fit base weight `name` of ne `base` (None: the model has no such tensor)."""
    if base is None:
        raise _refused(path, f"adapts {name}, which the model does not have; is it an adapter of another model?")
    if len(base) != 2:
        raise _refused(path, f"adapts {name}, which is not a weight matrix in the model")
    n_in, n_out = base
    (a0, a1), (b0, b1) = _ne(a), _ne(b)
    if name == _TOKEN_EMBD:  # llama.cpp looks rows of lora_a up by token id
        rank, fits = a0, (a0, a1, b0, b1) == (b0, n_out, a0, n_in)
        want = f"[rank, {n_out}] and [rank, {n_in}]"
    else:
        rank, fits = a1, (a0, a1, b0, b1) == (n_in, b0, a1, n_out)
        want = f"[{n_in}, rank] and [rank, {n_out}]"
    if not fits or rank > min(n_in, n_out):
        raise _refused(
            path,
            f"has {name}.lora_a {[a0, a1]} and .lora_b {[b0, b1]}, which do not fit the model's {[n_in, n_out]} "
            f"(want {want}, rank at most {min(n_in, n_out)})",
        )


def _ne(tensor: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in tensor.shape)


def _walk_header(
    path: str, *, max_metadata: int | None, max_tensors: int | None
) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """A GGUF file's string metadata and tensor shapes, read with struct (ValueError: not GGUF, a header
    that ends early, or more entries than the limits). gguf.GGUFReader makes a numpy view of every string
    in the file, which for a model's tokenizer (SmolLM2: 98k) takes 3-5 s; this walk takes 0.02 s."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        walk = _HeaderWalk(data)
        try:
            return walk.read(max_metadata, max_tensors)
        except (struct.error, UnicodeDecodeError, KeyError) as exc:
            raise ValueError(f"its header is cut short or malformed at byte {walk.pos}: {exc}") from None


class _HeaderWalk:
    """A cursor over a GGUF header: string metadata kept, the rest skipped, tensor shapes read."""

    _SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    """gguf.GGUFValueType -> bytes, for every type but STRING (8) and ARRAY (9)."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.pos = 0

    def read(
        self, max_metadata: int | None, max_tensors: int | None
    ) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
        if self.data[:4] != b"GGUF":
            raise ValueError("no GGUF magic at its start")
        _, _, num_tensors, num_metadata = self._unpack(_HEADER)
        if (max_metadata is not None and num_metadata > max_metadata) or (
            max_tensors is not None and num_tensors > max_tensors
        ):
            raise ValueError(f"it declares {num_tensors} tensors and {num_metadata} metadata keys, too many")
        strings: dict[str, str] = {}
        for _ in range(num_metadata):
            key = self._string()
            kind = self._unpack(_U32)[0]
            if kind == _STRING:
                strings[key] = self._string()
            else:
                self._skip(kind)
        shapes: dict[str, tuple[int, ...]] = {}
        for _ in range(num_tensors):
            name = self._string()
            n_dims = self._unpack(_U32)[0]
            shapes[name] = struct.unpack_from(f"<{n_dims}Q", self.data, self.pos)
            self.pos += 8 * n_dims + 12  # the dims, then the type (u32) and the data offset (u64)
        return strings, shapes

    def _unpack(self, layout: struct.Struct) -> tuple[Any, ...]:
        values = layout.unpack_from(self.data, self.pos)
        self.pos += layout.size
        return values

    def _string(self) -> str:
        n = self._unpack(_U64)[0]
        self.pos += n
        return self.data[self.pos - n : self.pos].decode()

    def _skip(self, kind: int) -> None:
        if kind == _STRING:
            n = self._unpack(_U64)[0]  # not `self.pos += self._unpack(...)`: that reads pos first
            self.pos += n
        elif kind == _ARRAY:
            item, n = self._unpack(_ARRAY_HEADER)
            if item in self._SCALARS:
                self.pos += n * self._SCALARS[item]
            else:
                for _ in range(n):
                    self._skip(item)
        else:
            self.pos += self._SCALARS[kind]
