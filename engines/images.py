"""Image bytes from the request plane into an engine's decoder: checked again here, whoever sent them.

The frontend checked each image (frontend/media.py), but a worker's request plane can be reached by others, so the
bytes are opened again with the same rules before a library decodes them: a PNG, JPEG, WebP or GIF only, the
header's size within MAX_PIXELS before any pixel is decoded, the whole image decoded on a thread (a corrupt file
is a RequestError for that request alone).
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Sequence
from typing import Any

from dynamo_cli.errors import RequestError
from dynamo_cli.wire import ImageInput

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_PIXELS = 64_000_000
"""The most pixels a worker decodes per image (above any frontend's --mm-max-pixels it should be given)."""


def decode_image(data: bytes, index: int = 0) -> Any:
    """A PIL RGB image of `data`; RequestError naming `images[index]` for anything else."""
    from PIL import Image, UnidentifiedImageError

    where = f"images[{index}]"
    try:
        with Image.open(io.BytesIO(data), formats=list(FORMATS)) as image:
            if image.width * image.height > MAX_PIXELS:
                raise RequestError(
                    f"{where}: {image.width} x {image.height} is over {MAX_PIXELS} pixels", param="messages"
                )
            return image.convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError, EOFError):
        raise RequestError(f"{where}: not an image this worker decodes, or a corrupt one", param="messages") from None


async def decode_images(images: Sequence[ImageInput]) -> list[Any]:
    """Every image of a request, decoded on a thread."""
    return await asyncio.to_thread(lambda: [decode_image(image.data, i) for i, image in enumerate(images)])


def collapsed(token_ids: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
    """`token_ids` with each image's run of placeholders cut to its first: for a library that expands one
    placeholder per image itself (vLLM, SGLang)."""
    out: list[int] = []
    at = 0
    for image in images:
        out += token_ids[at : image.offset + 1]
        at = image.offset + image.length
    return out + list(token_ids[at:])
