"""The mocker's vision encoder: time per image not in its embedding cache (an LRU of digests), counted.

An image costs its placeholder tokens in the prompt (prefill time, KV blocks: the scheduler sees them as any
token) plus, when its digest is not cached, `image_encode_ms` before the speedup ratio, spent before the request
is queued (the encoder runs ahead of the prefill, as vLLM's does). The blocks are hashed over the routing view
(kv/images.py), so the mocker's KV events name each image as the router does.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import MutableMapping

from dynamo_cli.wire import ImageInput, ImageSpec

from .config import MockerConfig


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
        self._cache: OrderedDict[str, None] = OrderedDict()
        self._counts = counts

    async def encode(self, images: list[ImageInput]) -> None:
        """Wait for the encoder's time of the images not cached; they are cached (and counted) once done."""
        missing = list(dict.fromkeys(image.digest for image in images if image.digest not in self._cache))
        self._counts["image_cache_hits"] += len(images) - len(missing)
        for digest in (image.digest for image in images):
            if digest in self._cache:
                self._cache.move_to_end(digest)
        if missing:
            await asyncio.sleep(self._encode_s * len(missing))
            self._counts["images_encoded"] += len(missing)
        for digest in missing:
            self._cache[digest] = None
            if len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
