"""Images at the edge: where an image URL may point (the SSRF policy), fetching within limits, checking the bytes.

A request's images are read before anything is routed, each failure a 400 naming the content part:

- `data:` URLs: base64 of a PNG, JPEG, WebP or GIF (no other type, no SVG), at most `--mm-max-image-mb`.
- `https:` URLs: the host is resolved once and every address checked; loopback, private, link-local, multicast and
  reserved addresses are refused (`--mm-allow-internal` allows them, and plain `http:`). The connection goes to the
  checked address (TLS verified against the URL's host), so a second DNS answer cannot move it (rebinding).
  Redirects are not followed; the reply must be a 200 with an image content type, under the size cap and
  `--mm-fetch-timeout` from connect to last byte.
- `file:` URLs: only under `--mm-local-dir`, after resolving links.

Then the bytes are decoded (off the event loop when large): the header's width x height must stay within
`--mm-max-pixels` before any pixel is decoded (decompression bombs), and the whole image must decode (a truncated
file is refused). `detail: "low"` downsizes to 512 px on the long side, as OpenAI's low detail does.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
from PIL import Image, UnidentifiedImageError

from dynamo_cli.config.media import MediaConfig
from dynamo_cli.errors import RequestError
from dynamo_cli.kv.images import image_digest

IMAGE_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
"""Pillow format -> the content type it is accepted under."""
LOW_DETAIL_PX = 512
INLINE_BYTES = 64 * 1024
"""Images up to this size are checked on the event loop; larger ones on a thread."""


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image a request names."""

    url: str
    detail: str
    param: str
    """The content part, as errors name it (`messages[1].content[0].image_url`)."""


@dataclass(frozen=True, slots=True)
class LoadedImage:
    """An image read and checked: its bytes as the engines get them, its identity and size."""

    data: bytes
    digest: str
    width: int
    height: int


async def load_images(refs: Sequence[ImageRef], config: MediaConfig) -> list[LoadedImage]:
    """Every image of a request, read at once; the first failure (a RequestError naming its part) cancels the rest."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(load_image(ref, config)) for ref in refs]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


async def load_image(ref: ImageRef, config: MediaConfig) -> LoadedImage:
    """One image, read by its URL's rule and checked."""
    raw = await _read(ref, config)
    if len(raw) <= INLINE_BYTES:
        return _checked(raw, ref, config)
    return await asyncio.to_thread(_checked, raw, ref, config)


async def _read(ref: ImageRef, config: MediaConfig) -> bytes:
    url = ref.url
    if url[:5].lower() == "data:":
        return _data_url(url, ref, config)
    scheme = urlsplit(url).scheme.lower()
    if scheme == "file":
        return await asyncio.to_thread(_local_file, url, ref, config)
    if scheme == "https" or (scheme == "http" and config.allow_internal):
        return await _fetch(url, ref, config)
    if scheme == "http":
        raise _refused(ref, "plain http: image URLs are refused; use https: or a data: URL (or --mm-allow-internal)")
    raise _refused(ref, f"image URLs must be data:, https: or file:, not '{scheme or url[:16]}'")


def _data_url(url: str, ref: ImageRef, config: MediaConfig) -> bytes:
    header, comma, payload = url[5:].partition(",")
    kind, *params = header.split(";")
    if not comma or "base64" not in (p.strip().lower() for p in params):
        raise _refused(ref, "a data: URL must be data:<image type>;base64,<data>")
    if kind.strip().lower() not in IMAGE_TYPES.values():
        raise _refused(ref, f"unsupported image type '{kind[:40]}'; send {', '.join(IMAGE_TYPES.values())}")
    if len(payload) > config.max_image_bytes * 4 // 3 + 4:
        raise _too_big(ref, config)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _refused(ref, "the data: URL is not valid base64") from None


def _local_file(url: str, ref: ImageRef, config: MediaConfig) -> bytes:
    if config.local_dir is None:
        raise _refused(ref, "file: image URLs are refused (the server has no --mm-local-dir)")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _refused(ref, "a file: URL names a local path (file:///path)")
    root = Path(config.local_dir).resolve()
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise _refused(ref, "that file is not an image under the server's --mm-local-dir")
    if path.stat().st_size > config.max_image_bytes:
        raise _too_big(ref, config)
    return path.read_bytes()


async def _fetch(url: str, ref: ImageRef, config: MediaConfig) -> bytes:
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        raise _refused(ref, "the image URL's port is not a number") from None
    if not host:
        raise _refused(ref, "the image URL has no host")
    try:
        async with asyncio.timeout(config.fetch_timeout_s):
            address = await _checked_address(host, port, ref, config)
            return await _get(url, host, address, port, ref, config)
    except TimeoutError:
        raise _refused(ref, f"fetching the image took over {config.fetch_timeout_s:g} s") from None


async def _checked_address(host: str, port: int, ref: ImageRef, config: MediaConfig) -> str:
    """The address to connect to: every address `host` resolves to must be public (unless allowed)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise _refused(ref, f"the image host '{host}' does not resolve") from None
    addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    if not config.allow_internal:
        for address in addresses:
            if not is_public(address):
                raise _refused(ref, f"the image host resolves to {address}, an internal address; such fetches are off")
    return str(addresses[0])


def is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A globally routable unicast address (an IPv4-mapped IPv6 address judged as its IPv4)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


async def _get(url: str, host: str, address: str, port: int, ref: ImageRef, config: MediaConfig) -> bytes:
    parts = urlsplit(url)
    literal = f"[{address}]" if ":" in address else address
    pinned = parts._replace(netloc=f"{literal}:{port}").geturl()
    headers = {"Host": parts.netloc.rpartition("@")[2], "Accept": ", ".join(IMAGE_TYPES.values())}
    limit = config.max_image_bytes
    try:
        async with (
            httpx.AsyncClient(timeout=config.fetch_timeout_s, follow_redirects=False, trust_env=False) as client,
            client.stream("GET", pinned, headers=headers, extensions={"sni_hostname": host}) as reply,
        ):
            if reply.status_code != 200:
                moved = " (redirects are not followed)" if 300 <= reply.status_code < 400 else ""
                raise _refused(ref, f"the image URL answered HTTP {reply.status_code}{moved}")
            kind = reply.headers.get("content-type", "").partition(";")[0].strip().lower()
            if kind not in IMAGE_TYPES.values():
                raise _refused(ref, f"the image URL sent '{kind[:40]}', not {', '.join(IMAGE_TYPES.values())}")
            if int(reply.headers.get("content-length") or 0) > limit:
                raise _too_big(ref, config)
            chunks, size = [], 0
            async for chunk in reply.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise _too_big(ref, config)
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as exc:
        raise _refused(ref, f"the image could not be fetched: {type(exc).__name__}") from None


def _checked(raw: bytes, ref: ImageRef, config: MediaConfig) -> LoadedImage:
    """Decode `raw` within the pixel cap; the bytes engines get (downsized for low detail) and their digest."""
    try:
        with Image.open(io.BytesIO(raw), formats=list(IMAGE_TYPES)) as image:
            width, height = image.size
            if width * height > config.max_pixels:
                raise _refused(ref, f"the image is {width} x {height}; at most {config.max_pixels} pixels are taken")
            image.load()  # every pixel: a truncated or corrupt file fails here
            if ref.detail == "low" and max(width, height) > LOW_DETAIL_PX:
                raw, width, height = _downsized(image)
    except UnidentifiedImageError:
        raise _refused(ref, f"not an image of a supported type ({', '.join(IMAGE_TYPES.values())})") from None
    except Image.DecompressionBombError:
        raise _refused(ref, f"the image has too many pixels (at most {config.max_pixels})") from None
    except (OSError, SyntaxError, ValueError, EOFError):
        raise _refused(ref, "the image is corrupt or truncated") from None
    return LoadedImage(raw, image_digest(raw), width, height)


def _downsized(image: Image.Image) -> tuple[bytes, int, int]:
    small = image.convert("RGB")
    small.thumbnail((LOW_DETAIL_PX, LOW_DETAIL_PX))
    out = io.BytesIO()
    small.save(out, format="PNG")
    return out.getvalue(), small.width, small.height


def _refused(ref: ImageRef, why: str) -> RequestError:
    return RequestError(f"{ref.param}: {why}", param=ref.param)


def _too_big(ref: ImageRef, config: MediaConfig) -> RequestError:
    return _refused(ref, f"the image is over {config.max_image_bytes // 1024} KiB (--mm-max-image-mb)")
