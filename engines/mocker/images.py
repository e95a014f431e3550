"""The mocker's vision encoder: time per image not in its embedding cache (an LRU of digests), counted.

An image costs its placeholder tokens in the prompt (prefill time, KV blocks: the scheduler sees them as any
token) plus, when its digest is not cached, `image_encode_ms` before the speedup ratio, spent before the request
is queued (the encoder runs ahead of the prefill, as vLLM's does). The blocks are hashed over the routing view
(kv/images.py), so the mocker's KV events name each image as the router does.

E/P/D: an encode-role mocker returns each image's embeddings, `image_tokens` x EMBED_DIM float16 made from the
digest (`embeddings`), which its worker holds for one pull; a serving mocker given them (`ImageInput.embeds`,
pulled by its worker) checks they are the image's and skips the encoder, as a cache hit.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import MutableMapping

from dynamo_cli.wire import ImageInput, ImageSpec

from .config import MockerConfig

EMBED_DIM = 1024
"""Width of one image token's embedding (a CLIP-L tower's; the projection into the LM is the serving side's)."""


def embeddings(digest: str, tokens: int) -> bytes:
    """The mocker's embeddings of the image with this digest: deterministic bytes of tokens x EMBED_DIM float16."""
    return hashlib.shake_256(digest.encode()).digest(tokens * EMBED_DIM * 2)


def image_spec(config: MockerConfig) -> ImageSpec | None:
    """What the mocker's card says of images: None unless `image_tokens` is set."""
    if not config.image_tokens:
        return None
    return ImageSpec(token_id=config.image_token_id, tokens_per_image=config.image_tokens, max_images=config.max_images)


class ImageEncoder:
    """Encodes (waits for) the images an embedding cache does not hold."""

    def __init__(self, config: MockerConfig, counts: MutableMapping[str, float]) -> None:
        self._encode_s = config.image_encode_ms / 1e3 / config.speedup_ratio
        self._capacity = config.image_cache_size
        self._tokens = config.image_tokens
        self._cache: OrderedDict[str, None] = OrderedDict()
        self._counts = counts

    async def encode_images(self, images: list[ImageInput]) -> tuple[list[bytes], int]:
        """An encode worker's part: each image's embeddings (after the encoder's time for those not cached), and
        how many were cached."""
        cached = sum(image.digest in self._cache for image in images)
        await self.encode(images)
        return [embeddings(image.digest, self._tokens) for image in images], cached

    async def encode(self, images: list[ImageInput]) -> None:
        """Wait for the encoder's time of the images not cached and without embeddings from an encode worker; they
        are cached (and counted) once done."""
        flags = [self._received(image) for image in images]
        received = [image.digest for image, flag in zip(images, flags, strict=True) if flag]
        rest = [image.digest for image, flag in zip(images, flags, strict=True) if not flag]
        missing = list(dict.fromkeys(digest for digest in rest if digest not in self._cache))
        self._counts["image_embeds_received"] += len(received)
        self._counts["image_cache_hits"] += len(rest) - len(missing)
        for digest in received + rest:
            if digest in self._cache:
                self._cache.move_to_end(digest)
        for digest in received:
            self._cache[digest] = None
        if missing:
            await asyncio.sleep(self._encode_s * len(missing))
            self._counts["images_encoded"] += len(missing)
        for digest in missing:
            self._cache[digest] = None
        while len(self._cache) > self._capacity:
            self._cache.popitem(last=False)

    def _received(self, image: ImageInput) -> bool:
        """Whether the image came with its own embeddings (checked: they must be this image's)."""
        embeds = image.embeds
        return embeds is not None and embeds.payload == embeddings(image.digest, self._tokens)
