"""Images in the routing view of a prompt: the scheme SGLang and Dynamo 1.6 share ("pad values").

Each placeholder token of an image is replaced, in a routing-only copy of the token ids, by a value derived
from the image's digest: `IMAGE_PAD_BASE + (first 64 bits of the digest & (2**30 - 1))`. Block hashes are then
plain token hashes (kv/hashing.py), so a repeated image earns cache credit where it was seen and a different
image behind the same text does not. The router hashes this view (core/request_plan.py `routing_ids`), and
engines publish KV events over the same view (the mocker hashes it; vLLM's events name the image by the digest
we pass as its uuid, engines/vllm/kv_events.py), so the index and the events agree.

The pads start above any vocabulary (1,000,000) and fit the u32 the hashes pack tokens into.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

IMAGE_PAD_BASE = 1_000_000
_PAD_MASK = 2**30 - 1


class ImageRun(Protocol):
    """An image's run of placeholders (wire.ImageInput)."""

    @property
    def digest(self) -> str: ...

    @property
    def offset(self) -> int: ...

    @property
    def length(self) -> int: ...


def image_digest(data: bytes) -> str:
    """An image's identity: BLAKE2b-256 of its bytes, 64 hex digits."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def pad_value(digest: str) -> int:
    """The token that stands for every placeholder of the image with this digest in the routing view."""
    return IMAGE_PAD_BASE + (int(digest[:16], 16) & _PAD_MASK)


def routed_tokens(token_ids: Sequence[int], images: Sequence[ImageRun]) -> list[int]:
    """`token_ids` with each image's placeholders replaced by its pad value (a copy; as is with no images)."""
    out = list(token_ids)
    for image in images:
        end = min(image.offset + image.length, len(out))
        out[image.offset : end] = [pad_value(image.digest)] * (end - image.offset)
    return out
