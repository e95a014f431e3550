"""The mocker's vision encoder: time per image not in its embedding cache (an LRU of digests), counted.

An image costs its placeholder tokens in the prompt (prefill time, KV blocks: the scheduler sees them as any
token) plus, when its digest is not cached, `image_encode_ms` (before the speedup ratio) added to the pass that
starts its prefill: the vision tower runs on the same GPU as the language model, inside the step, as vLLM's does,
so every request of that pass waits for it. The blocks are hashed over the routing view (kv/images.py), so the
mocker's KV events name each image as the router does.

E/P/D: an encode-role mocker runs its encoder one call at a time (its own GPU) and returns each image's
embeddings, a compact stand-in (`embeddings`: EMBED_BYTES per token made from the digest) of the real tokens x
EMBED_DIM float16, which its worker holds for one pull. A serving mocker given them (`ImageInput.embeds`, pulled
by its worker) checks they are the image's, waits the modelled transfer of the real size at
`kv_transfer_bandwidth` (0: none, as for KV) and skips the encoder, as a cache hit.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import MutableMapping

from dynamo_cli.wire import ImageInput, ImageSpec

from .config import MockerConfig

EMBED_DIM = 4096
"""Width of one image token's embedding, projected into the language model (LLaVA-1.5-7B's)."""
EMBED_BYTES = 16
"""Bytes per token of the mocker's stand-in embeddings (the real ones, EMBED_DIM x 2, are modelled, not sent)."""


def embeddings(digest: str, tokens: int) -> bytes:
    """The mocker's embeddings of the image with this digest: deterministic, EMBED_BYTES per token."""
    return hashlib.shake_256(digest.encode()).digest(tokens * EMBED_BYTES)


def image_spec(config: MockerConfig) -> ImageSpec | None:
    """What the mocker's card says of images: None unless `image_tokens` is set."""
    if not config.image_tokens:
        return None
    return ImageSpec(token_id=config.image_token_id, tokens_per_image=config.image_tokens, max_images=config.max_images)


class ImageEncoder:
    """The images an embedding cache does not hold: the encoder time they cost, counted."""

    def __init__(self, config: MockerConfig, counts: MutableMapping[str, float]) -> None:
        self._encode_ms = config.image_encode_ms / config.speedup_ratio
        self._capacity = config.image_cache_size
        self._tokens = config.image_tokens
        self._transfer_s = config.transfer_delay_s(config.image_tokens * EMBED_DIM * 2)
        self._cache: OrderedDict[str, None] = OrderedDict()
        self._counts = counts
        self._gpu = asyncio.Lock()
        """An encode worker's encoder: one call at a time."""

    async def encode_images(self, images: list[ImageInput]) -> tuple[list[bytes], int]:
        """An encode worker's part: each image's embeddings (after the encoder's time for those not cached, one
        call at a time), and how many were cached."""
        async with self._gpu:
            cached = sum(image.digest in self._cache for image in images)
            owed_ms = self.owed_ms(images)
            if owed_ms:
                await asyncio.sleep(owed_ms / 1e3)
        return [embeddings(image.digest, self._tokens) for image in images], cached

    async def prepare(self, images: list[ImageInput]) -> float:
        """A serving mocker's part: wait the modelled transfer of the embeddings an encode worker sent, then the
        encoder time the rest owe (`owed_ms`)."""
        flags = [self._received(image) for image in images]
        if self._transfer_s and any(flags):
            await asyncio.sleep(self._transfer_s * sum(flags))
        return self.owed_ms(images, flags)

    def owed_ms(self, images: list[ImageInput], flags: list[bool] | None = None) -> float:
        """The encoder's time for the images not cached and without embeddings from an encode worker (`flags`: which
        came with theirs, checked); they are cached (and counted) now, as the pass that prefills them will have them."""
        flags = flags if flags is not None else [self._received(image) for image in images]
        received = [image.digest for image, flag in zip(images, flags, strict=True) if flag]
        rest = [image.digest for image, flag in zip(images, flags, strict=True) if not flag]
        missing = list(dict.fromkeys(digest for digest in rest if digest not in self._cache))
        self._counts["image_embeds_received"] += len(received)
        self._counts["image_cache_hits"] += len(rest) - len(missing)
        self._counts["images_encoded"] += len(missing)
        for digest in received + rest:
            if digest in self._cache:
                self._cache.move_to_end(digest)
        for digest in received + missing:
            self._cache[digest] = None
        while len(self._cache) > self._capacity:
            self._cache.popitem(last=False)
        return self._encode_ms * len(missing)

    def _received(self, image: ImageInput) -> bool:
        """Whether the image came with its own embeddings (checked: they must be this image's)."""
        embeds = image.embeds
        return embeds is not None and embeds.payload == embeddings(image.digest, self._tokens)
