"""Images on vLLM: the card's ImageSpec, measured from the model's own processor, and a request's images as
vLLM's multi-modal prompt.

The frontend expands each image into `tokens_per_image` placeholders (kv/images.py routes them by content); vLLM
wants one placeholder per image and expands it itself (LLaVA: `<image>` x N; Idefics3 without image splitting:
`<fake_token_around_image><global-img><image>` x N `<fake_token_around_image>`). So each run is cut back to one
placeholder (`collapsed`) and vLLM's expansion has the run's length: positions agree, and so do the KV events,
whose `(identifier, offset)` extra keys name the image by the digest passed here as its uuid (kv_events.py).

Only models whose images take a fixed number of tokens fit (LLaVA-1.5, Idefics3 and SmolVLM without image
splitting): `tokens_per_image` is measured once at start on a blank image, and a request whose image vLLM
expands to another length fails alone (vLLM's own check). Images are served on `--role both` only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from dynamo_cli.engine import Role
from dynamo_cli.wire import ImageInput, ImageSpec

from ..images import collapsed, decode_images
from .kv_events import ZmqKvRelay

logger = logging.getLogger(__name__)


async def served_images(
    role: Role, model_config: Any, model_path: str, engine_kwargs: dict[str, Any], relay: ZmqKvRelay | None
) -> ImageSpec | None:
    """The card's ImageSpec (a `--role both` engine of an image model), its KV event relay told of it."""
    if role is not Role.BOTH:
        return None
    kwargs = engine_kwargs.get("mm_processor_kwargs")
    spec = await asyncio.to_thread(image_spec, model_config, model_path, kwargs)
    if spec is not None and relay is not None:
        relay.read_images(spec.tokens_per_image)
    return spec


def image_spec(model_config: Any, model_path: str, processor_kwargs: dict[str, Any] | None) -> ImageSpec | None:
    """How the served model takes images; None for a text model (or a model with images of no fixed size)."""
    if not getattr(model_config, "is_multimodal_model", False):
        return None
    hf = model_config.hf_config
    token_id = getattr(hf, "image_token_id", None)
    token_id = token_id if isinstance(token_id, int) else getattr(hf, "image_token_index", None)
    if not isinstance(token_id, int):
        return None
    limit = model_config.multimodal_config.get_limit_per_prompt("image")
    tokens = tokens_per_image(model_path, processor_kwargs)
    if tokens is None:
        logger.warning(
            "vllm: %s's images take a number of tokens that depends on their size: images refused", model_path
        )
        return None
    return ImageSpec(token_id=token_id, tokens_per_image=tokens, max_images=max(1, limit))


def tokens_per_image(model_path: str, processor_kwargs: dict[str, Any] | None) -> int | None:
    """What one image expands to with the model's processor (its placeholder text with a blank image, less the
    placeholder text alone, plus the placeholder), measured at two sizes; None when they differ."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path, **(processor_kwargs or {}))  # type: ignore[no-untyped-call, unused-ignore]
    text = str(processor.image_token)
    alone = len(processor.tokenizer(text)["input_ids"])
    counts = {
        len(processor(text=text, images=[Image.new("RGB", size)])["input_ids"][0]) - alone + 1
        for size in ((64, 64), (1280, 720))
    }
    return counts.pop() if len(counts) == 1 else None


async def vllm_prompt(lib: Any, token_ids: Sequence[int], options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """vLLM's `TokensPrompt` of a request's ids and `options["images"]`: the ids as they are, or one placeholder per
    image with the pictures by digest; and the rest of `options` (generate's keyword arguments)."""
    images: Sequence[ImageInput] = options.get("images", ())
    rest = {key: value for key, value in options.items() if key != "images"}
    if not images:
        return lib.tokens_prompt_cls(prompt_token_ids=list(token_ids)), rest
    pictures = await decode_images(images)
    prompt = lib.tokens_prompt_cls(
        prompt_token_ids=collapsed(token_ids, images),
        multi_modal_data={"image": pictures},
        multi_modal_uuids={"image": [image.digest for image in images]},
    )
    return prompt, rest
