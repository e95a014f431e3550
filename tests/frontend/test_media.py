"""Images at the edge (frontend/media.py): each hostile input a RequestError naming its part, good images read
and hashed; the routing view (kv/images.py) and the workers' check of the runs (engine.check_images)."""

from __future__ import annotations

import asyncio
import base64
import io
import random
import struct
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from dynamo_cli.config.media import MediaConfig
from dynamo_cli.engine import check_images
from dynamo_cli.errors import RequestError
from dynamo_cli.frontend.media import ImageRef, LoadedImage, is_public, load_image, load_images
from dynamo_cli.kv.hashing import block_hashes
from dynamo_cli.kv.images import IMAGE_PAD_BASE, image_digest, pad_value, routed_tokens
from dynamo_cli.wire import GenerateRequest, ImageInput, ImageSpec

PARAM = "messages[0].content[1].image_url"


def png(width: int = 8, height: int = 8, color: tuple[int, int, int] = (200, 10, 10)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def noisy_png(side: int = 64) -> bytes:
    out = io.BytesIO()
    Image.frombytes("RGB", (side, side), random.Random(side).randbytes(side * side * 3)).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height, with a few rows of zeros: tiny on the wire."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    rows = zlib.compress(b"\x00" * (width + 1) * 4, 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def load(url: str, config: MediaConfig | None = None, detail: str = "auto") -> LoadedImage:
    return asyncio.run(load_image(ImageRef(url, detail, PARAM), config or MediaConfig()))


def refused(url: str, config: MediaConfig | None = None) -> str:
    with pytest.raises(RequestError) as info:
        load(url, config)
    assert info.value.param == PARAM
    return str(info.value)


def test_a_data_url_image_is_read_checked_and_hashed() -> None:
    data = png(16, 12)
    image = load(data_url(data))
    assert (image.width, image.height, image.data) == (16, 12, data)
    assert image.digest == image_digest(data) and len(image.digest) == 64


def test_low_detail_downsizes_to_512_px() -> None:
    image = load(data_url(png(1024, 256)), detail="low")
    assert (image.width, image.height) == (512, 128)
    assert image.digest == image_digest(image.data)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        (data_url(noisy_png()[:2000]), "corrupt or truncated"),
        (data_url(png()[:30]), "not an image"),
        (data_url(b"\xff\xd8\xff\xe0" + b"\x00" * 30, "image/jpeg"), "not an image"),
        (data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml"), "unsupported image type"),
        (data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>"), "not an image"),
        (data_url(zlib.compress(b"\x00" * 10_000_000), "application/zip"), "unsupported image type"),
        (data_url(bomb_png(30_000, 30_000)), "too many pixels"),
        (data_url(bomb_png(20_000, 20_000)), "too many pixels"),
        (data_url(bomb_png(6_000, 5_000)), "6000 x 5000"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/png," + "A" * 8, "base64"),
        ("http://127.0.0.1/cat.png", "plain http"),
        ("https://127.0.0.1/cat.png", "internal address"),
        ("https://10.1.2.3/cat.png", "internal address"),
        ("https://169.254.169.254/latest/meta-data", "internal address"),
        ("https://[::1]/cat.png", "internal address"),
        ("https://[::ffff:192.168.0.1]/cat.png", "internal address"),
        ("file:///etc/passwd", "--mm-local-dir"),
        ("ftp://example.com/cat.png", "data:, https: or file:"),
    ],
)
def test_hostile_images_are_refused_naming_the_part(url: str, why: str) -> None:
    assert why in refused(url)


def test_an_image_over_the_size_cap_is_refused_before_it_is_decoded() -> None:
    assert "over 1 KiB" in refused(
        data_url(png(256, 256, (1, 2, 3)) + b"\x00" * 4096), MediaConfig(max_image_bytes=1024)
    )


def test_the_pixel_cap_is_a_setting() -> None:
    assert "at most 100 pixels" in refused(data_url(png(11, 10)), MediaConfig(max_pixels=100))
    assert load(data_url(png(10, 10)), MediaConfig(max_pixels=100)).width == 10


def test_file_urls_only_under_the_local_dir(tmp_path: Path) -> None:
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "cat.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png())
    (tmp_path / "ok" / "link.png").symlink_to(tmp_path / "secret.png")
    config = MediaConfig(local_dir=str(tmp_path / "ok"))
    assert load(f"file://{tmp_path}/ok/cat.png", config).width == 8
    for outside in (
        f"file://{tmp_path}/secret.png",
        f"file://{tmp_path}/ok/../secret.png",
        f"file://{tmp_path}/ok/link.png",
    ):
        assert "not an image under" in refused(outside, config)


def test_public_addresses() -> None:
    import ipaddress

    assert is_public(ipaddress.ip_address("8.8.8.8"))
    for internal in (
        "127.0.0.1",
        "10.0.0.1",
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "fe80::1",
    ):
        assert not is_public(ipaddress.ip_address(internal)), internal


class _Images(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/cat.png":
            body, kind = png(20, 10), "image/png"
        elif self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/")
            self.end_headers()
            return
        elif self.path == "/page.html":
            body, kind = b"<html></html>", "text/html"
        elif self.path == "/huge.png":
            body, kind = png() + b"\x00" * 200_000, "image/png"
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_fetches_are_off_for_internal_hosts_unless_allowed(image_server: str) -> None:
    assert "plain http" in refused(f"{image_server}/cat.png")
    allowed = MediaConfig(allow_internal=True, max_image_bytes=100_000)
    assert load(f"{image_server}/cat.png", allowed).width == 20
    assert "redirects are not followed" in refused(f"{image_server}/moved.png", allowed)
    assert "'text/html'" in refused(f"{image_server}/page.html", allowed)
    assert "HTTP 404" in refused(f"{image_server}/gone.png", allowed)
    assert "over 97 KiB" in refused(f"{image_server}/huge.png", allowed)


def test_a_fetch_that_hangs_ends_at_its_timeout() -> None:
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # accepts, never answers
    try:
        config = MediaConfig(allow_internal=True, fetch_timeout_s=0.3)
        assert "took over 0.3 s" in refused(f"http://127.0.0.1:{listener.getsockname()[1]}/x.png", config)
    finally:
        listener.close()


def test_one_bad_image_fails_the_request_naming_its_part() -> None:
    refs = [
        ImageRef(data_url(png()), "auto", "messages[0].content[0].image_url"),
        ImageRef("x:", "auto", "messages[1].content[2].image_url"),
    ]
    with pytest.raises(RequestError) as info:
        asyncio.run(load_images(refs, MediaConfig()))
    assert info.value.param == "messages[1].content[2].image_url"


##### the routing view and the workers' check #####


def test_the_routing_view_puts_the_digest_where_the_placeholders_were() -> None:
    a, b = image_digest(png(color=(1, 1, 1))), image_digest(png(color=(2, 2, 2)))
    tokens = [5, 6] + [0] * 4 + [7]
    view_a = routed_tokens(tokens, [ImageInput(digest=a, offset=2, length=4)])
    assert view_a == [5, 6] + [pad_value(a)] * 4 + [7] and tokens[2] == 0
    assert IMAGE_PAD_BASE <= pad_value(a) < IMAGE_PAD_BASE + 2**30
    view_b = routed_tokens(tokens, [ImageInput(digest=b, offset=2, length=4)])
    # the same image again hashes the same; another image behind the same text does not
    assert block_hashes(view_a, 2)[0] == block_hashes(view_b, 2)[0]
    assert block_hashes(view_a, 2)[1:] != block_hashes(view_b, 2)[1:]
    assert routed_tokens(tokens, []) == tokens


SPEC = ImageSpec(token_id=0, tokens_per_image=4, max_images=2)


def request_with(tokens: list[int], *images: ImageInput) -> GenerateRequest:
    return GenerateRequest(request_id="r", token_ids=tokens, max_tokens=4, images=list(images))


def image(offset: int, length: int = 4, digest: str = "ab" * 32, data: bytes = b"png") -> ImageInput:
    return ImageInput(digest=digest, offset=offset, length=length, data=data)


def test_workers_check_each_run_before_a_decoder_sees_the_bytes() -> None:
    tokens = [9, 0, 0, 0, 0, 9, 0, 0, 0, 0]
    check_images(request_with(tokens, image(1), image(6)), SPEC)
    check_images(request_with([9, 9]), None)
    bad = [
        (request_with(tokens, image(1)), "outside the images. runs"),  # a run of placeholders with no image
        (request_with(tokens, image(1), image(6), image(6)), "at most 2"),
        (request_with(tokens, image(1, digest="xyz"), image(6)), "64 lowercase hex"),
        (request_with(tokens, image(1, data=b""), image(6)), "bytes"),
        (request_with(tokens, image(1, length=3), image(6)), "do not fit"),
        (request_with(tokens, image(6), image(1)), "outside the images' runs"),
        (request_with(tokens, image(1), image(7)), "do not fit"),
        (request_with([9, 9, 9, 9, 9, 9], image(1)), "not placeholder tokens"),
    ]
    for request, why in bad:
        with pytest.raises(RequestError, match=why):
            check_images(request, SPEC)
    with pytest.raises(RequestError, match="text only"):
        check_images(request_with(tokens, image(1), image(6)), None)
