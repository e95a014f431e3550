"""Where the frontend may take images from and how big they may be (frontend/media.py applies it)."""

from __future__ import annotations

from dataclasses import dataclass

from dynamo_cli.engine import MAX_IMAGE_BYTES
from dynamo_cli.errors import ConfigError
from dynamo_cli.settings import IN_MIB, MEDIA, setting


@dataclass(frozen=True, slots=True)
class MediaConfig:
    """Image URLs: the SSRF policy, the fetch's limits, the decoder's pixel cap."""

    allow_internal: bool = setting(
        False, "--mm-allow-internal/--no-mm-allow-internal", env="DYN_MM_ALLOW_INTERNAL", panel=MEDIA
    )
    """Fetch image URLs that are plain http: or resolve to loopback, private, link-local or reserved addresses
    (off: https: to public addresses only, and data: URLs; Dynamo's DYN_MM_ALLOW_INTERNAL)."""
    local_dir: str | None = setting(None, "--mm-local-dir", env="DYN_MM_LOCAL_PATH", panel=MEDIA)
    """Serve file:// image URLs from under this directory only (unset: file:// is refused)."""
    fetch_timeout_s: float = setting(10.0, "--mm-fetch-timeout", env="DYN_MM_FETCH_TIMEOUT", panel=MEDIA)
    """Seconds one image fetch may take, connection to last byte."""
    max_image_bytes: int = setting(
        10 * 1024 * 1024, "--mm-max-image-mb", env="DYN_MM_MAX_IMAGE_MB", panel=MEDIA, **IN_MIB
    )
    """Largest image file (MiB), fetched or inline."""
    max_pixels: int = setting(25_000_000, "--mm-max-pixels", env="DYN_MM_MAX_PIXELS", panel=MEDIA)
    """Most pixels (width x height) an image may declare: larger is refused before it is decoded (bombs)."""

    def __post_init__(self) -> None:
        if not 0 < self.max_image_bytes <= MAX_IMAGE_BYTES:
            raise ConfigError(f"--mm-max-image-mb must be above 0 and at most {MAX_IMAGE_BYTES // 2**20}")
        if self.max_pixels < 1 or self.fetch_timeout_s <= 0:
            raise ConfigError("--mm-max-pixels and --mm-fetch-timeout must be above 0")
