"""Images end to end on a mocker deployment that takes them (`--engine-arg image_tokens=32`), with the official
clients: a repeated image is a cache hit where it was seen and a different image behind the same text is not;
the Anthropic and Responses translations carry images; hostile images are 400s naming the part while their
neighbours complete; a text-only model refuses images naming itself; the embedding cache skips the encoder."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import random
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from tests.conftest import DynProcess
from tests.e2e.test_prometheus import consecutive_free_ports
from tests.frontend.test_media import bomb_png, noisy_png

SYSTEM = "You are a careful assistant who describes pictures in one short sentence. " * 12
"""A shared prefix of several blocks (64 tokens each in the mocker) before the image."""


def png_url(seed: int, side: int = 48) -> str:
    out = io.BytesIO()
    Image.frombytes("RGB", (side, side), random.Random(seed).randbytes(side * side * 3)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def chat(url: str, text: str = "What is in this picture?") -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]},
    ]


@pytest.fixture(scope="module")
def served(dyn_serve_module) -> Iterator[DynProcess]:  # type: ignore[no-untyped-def]
    """Two mocker workers that take images (32 tokens each), KV routing; a text-only model beside them."""
    base = consecutive_free_ports(2)
    d: DynProcess = dyn_serve_module(
        "--engine", "mocker", "--workers", "2", "--router", "kv", "--speedup-ratio", "10",
        "--engine-arg", "image_tokens=32", "--engine-arg", "max_images=4", "--system-port", str(base),
    )  # fmt: skip
    d.system_ports = [base, base + 1]  # type: ignore[attr-defined]
    yield d


def client(d: DynProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=60)


def ask(d: DynProcess, messages: list[dict[str, Any]], **extra: Any) -> tuple[Any, dict[str, Any]]:
    raw = client(d).chat.completions.with_raw_response.create(
        model="smollm2", messages=messages, max_tokens=3, extra_headers={"x-dyn-explain-route": "1"}, **extra
    )
    return raw.parse(), json.loads(raw.headers["x-dyn-route"])


def overlap(route: dict[str, Any]) -> int:
    chosen = route["worker_id"]
    return max(c["overlap_blocks"] for c in route["candidates"] if c["worker_id"] == chosen)


def test_a_repeated_image_is_a_cache_hit_and_another_image_is_not(served: DynProcess) -> None:
    first, _ = ask(served, chat(png_url(1)))
    again, route = ask(served, chat(png_url(1)))
    other, other_route = ask(served, chat(png_url(2)))
    prompt = first.usage.prompt_tokens
    assert prompt == again.usage.prompt_tokens == other.usage.prompt_tokens  # 32 placeholders per image
    full_blocks = prompt // 64
    assert overlap(route) == full_blocks and again.usage.prompt_tokens_details.cached_tokens == full_blocks * 64
    # the same text with another image: credit for the text before the image only
    image_at = len(served_tokens_before_image(served))
    assert overlap(other_route) == image_at // 64 < full_blocks
    assert other.usage.prompt_tokens_details.cached_tokens == image_at // 64 * 64


def served_tokens_before_image(d: DynProcess) -> list[int]:
    """The prompt's ids up to the image: the same chat with the image part left out, less its tail."""
    body = {"model": "smollm2", "messages": [{"role": "system", "content": SYSTEM}], "max_tokens": 1}
    prompt = httpx.post(f"{d.url}/v1/chat/completions", json=body, headers=d.auth, timeout=30).json()
    n_system = prompt["usage"]["prompt_tokens"]
    with_text = chat(png_url(1))[:1] + [{"role": "user", "content": "What is in this picture?"}]
    body["messages"] = with_text
    n_text = httpx.post(f"{d.url}/v1/chat/completions", json=body, headers=d.auth, timeout=30).json()["usage"]
    assert n_text["prompt_tokens"] > n_system
    # system turn + the user turn's header and text, before the end-of-turn and generation prompt (5 tokens)
    return [0] * (n_text["prompt_tokens"] - 5)


def test_the_anthropic_and_responses_apis_carry_images(served: DynProcess) -> None:
    data = png_url(3).partition(",")[2]
    messages = anthropic.Anthropic(base_url=served.url, api_key=served.api_key, max_retries=0).messages.create(
        model="smollm2",
        max_tokens=3,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
    )
    assert messages.usage.input_tokens > 32 and messages.stop_reason == "max_tokens"
    response = client(served).responses.create(
        model="smollm2",
        max_output_tokens=3,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": png_url(3), "detail": "low"},
                ],
            }
        ],
    )
    assert response.status == "incomplete" and response.usage.input_tokens > 32  # at max_output_tokens


HOSTILE = {
    "truncated PNG": "data:image/png;base64," + base64.b64encode(noisy_png()[:2000]).decode(),
    "30000 x 30000": "data:image/png;base64," + base64.b64encode(bomb_png(30_000, 30_000)).decode(),
    "zip in a data URL": "data:application/zip;base64," + base64.b64encode(b"PK\x03\x04" + b"\x00" * 512).decode(),
    "SVG": "data:image/svg+xml;base64," + base64.b64encode(b"<svg xmlns='http://www.w3.org/2000/svg'/>").decode(),
    "loopback URL": "https://127.0.0.1/cat.png",
    "private URL": "https://192.168.7.7/cat.png",
    "metadata URL": "http://169.254.169.254/latest/meta-data/",
}


def test_hostile_images_are_400s_naming_the_part_and_neighbours_complete(served: DynProcess) -> None:
    def good(i: int) -> str:
        reply, _ = ask(served, chat(png_url(100 + i)), stream=False)
        return str(reply.choices[0].finish_reason)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        neighbours = [pool.submit(good, i) for i in range(8)]
        for name, url in HOSTILE.items():
            with pytest.raises(openai.BadRequestError) as info:
                ask(served, chat(url))
            error = info.value.body
            assert isinstance(error, dict) and error["param"] == "messages[1].content[1].image_url", (name, error)
        assert [f.result(timeout=60) for f in neighbours] == ["length"] * 8
    too_many = [{"type": "image_url", "image_url": {"url": png_url(7)}}] * 100
    with pytest.raises(openai.BadRequestError, match="100 images; model 'smollm2' takes at most 4"):
        ask(served, [{"role": "user", "content": too_many}])
    with pytest.raises(openai.BadRequestError, match="may not hold"):
        ask(served, chat(png_url(8), text="a marker <|dyn-image|> in the text"))
    assert ask(served, chat(png_url(9)))[0].choices[0].finish_reason == "length"  # the workers are alive


def test_a_text_only_model_refuses_images_naming_itself(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve("--engine", "mocker", "--served-model-name", "texty", "--speedup-ratio", "100")
    with pytest.raises(openai.BadRequestError, match="model 'texty' takes text only") as info:
        client(d).chat.completions.create(model="texty", messages=chat(png_url(1)), max_tokens=2)  # type: ignore[arg-type]
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "messages[1].content[1].image_url"


def test_the_embedding_cache_skips_the_encoder_for_a_repeated_image(served: DynProcess) -> None:
    def counts() -> tuple[float, float]:
        encoded = hits = 0.0
        for port in served.system_ports:  # type: ignore[attr-defined]
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            encoded += metric(text, "dynamo_component_engine_images_encoded_total")
            hits += metric(text, "dynamo_component_engine_image_cache_hits_total")
        return encoded, hits

    before = counts()
    ask(served, chat(png_url(50)))
    mid = counts()
    ask(served, chat(png_url(50)))  # routed where its blocks are: that worker's encoder cache holds it
    after = counts()
    assert mid[0] - before[0] == 1 and after[0] == mid[0]
    assert after[1] - mid[1] == 1


def metric(text: str, name: str, label: str = "") -> float:
    found = re.findall(rf"^{name}\{{([^}}]*)\}} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for labels, v in found if label in labels)


##### E/P/D: an encode worker beside the serving ones #####


@pytest.fixture(scope="module")
def epd(dyn_serve_module) -> Iterator[DynProcess]:  # type: ignore[no-untyped-def]
    """One aggregated mocker worker and one encode worker (`--encode-workers 1`), every image to the encoder."""
    base = consecutive_free_ports(2)
    d: DynProcess = dyn_serve_module(
        "--engine", "mocker", "--workers", "1", "--encode-workers", "1", "--encode-min-kb", "0",
        "--encode-timeout", "1", "--router", "kv", "--speedup-ratio", "10", "--engine-arg", "image_tokens=32",
        "--system-port", str(base),
    )  # fmt: skip
    d.system_ports = [base, base + 1]  # type: ignore[attr-defined]
    yield d


def frontend_metric(d: DynProcess, outcome: str) -> float:
    text = httpx.get(f"{d.url}/metrics", headers=d.auth, timeout=10).text
    return metric(text, "dynamo_frontend_disagg_decisions_total", f'outcome="encode_{outcome}"')


def worker_metric(d: DynProcess, index: int, name: str) -> float:
    port = d.system_ports[index]  # type: ignore[attr-defined]
    return metric(
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text, f"dynamo_component_engine_{name}_total"
    )


def image_first(url: str) -> list[dict[str, Any]]:
    """The image, then text of more than a block: its run ends inside the prompt's full blocks."""
    text = "Describe the colours, the shapes and the mood of this picture, in plain words. " * 6
    return [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}
    ]


def test_epd_encodes_on_the_encode_worker_and_serves_the_aggregated_text(served: DynProcess, epd: DynProcess) -> None:
    messages = image_first(png_url(60))
    aggregated, _ = ask(served, messages, seed=7)
    before = (frontend_metric(epd, "remote"), worker_metric(epd, 1, "images_encoded"))
    disaggregated, _ = ask(epd, messages, seed=7)
    assert disaggregated.choices[0].message.content == aggregated.choices[0].message.content
    assert frontend_metric(epd, "remote") == before[0] + 1
    assert worker_metric(epd, 1, "images_encoded") == before[1] + 1  # the encoder ran it
    assert worker_metric(epd, 0, "image_embeds_received") >= 1  # the serving worker pulled, did not encode
    assert worker_metric(epd, 0, "images_encoded") == 0
    cached = frontend_metric(epd, "prefix_cached")
    ask(epd, messages, seed=7)  # its blocks are on the serving worker: no encode hop at all
    assert frontend_metric(epd, "prefix_cached") == cached + 1


def test_an_encode_worker_that_dies_leaves_the_images_to_the_serving_worker(epd: DynProcess) -> None:
    import os
    import signal

    (pid,) = [r.pid for r in epd.instance_records() if r.role == "encode"]
    os.kill(pid, signal.SIGSTOP)  # hung, still registered: the call times out or fails, the request goes on
    try:
        failed = frontend_metric(epd, "failed")
        reply, _ = ask(epd, chat(png_url(61)))
        assert reply.choices[0].finish_reason == "length"
        assert frontend_metric(epd, "failed") == failed + 1
        assert worker_metric(epd, 0, "images_encoded") >= 1  # encoded where it was served
    finally:
        os.kill(pid, signal.SIGCONT)


##### at scale: image-aware routing finds the repeated images #####


def hit_rate(d: DynProcess, rng: random.Random, requests: int = 80) -> float:
    """Closed loop, 4 at a time: half the requests repeat one of 20 images; cached over prompt tokens."""
    repeated = [png_url(1000 + i) for i in range(20)]

    def one(i: int) -> tuple[int, int]:
        url = repeated[i % 20] if i % 2 else png_url(2000 + i)
        reply, _ = ask(d, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
        return reply.usage.prompt_tokens_details.cached_tokens or 0, reply.usage.prompt_tokens

    order = list(range(requests))
    rng.shuffle(order)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        rows = list(pool.map(one, order))
    return sum(c for c, _ in rows) / sum(p for _, p in rows)


def test_image_aware_routing_finds_repeated_images_that_image_blind_routing_misses(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    common = ["--engine", "mocker", "--workers", "4", "--router", "kv", "--speedup-ratio", "20"]
    common += ["--engine-arg", "image_tokens=256", "--num-gpu-blocks", "48"]  # 5 blocks a prompt: 9 prompts a worker
    aware = hit_rate(dyn_serve(*common), random.Random(1))
    blind = hit_rate(dyn_serve(*common, "--no-router-image-hashes"), random.Random(1))
    assert aware > blind + 0.1, (aware, blind)


def test_encode_prefill_decode_each_on_its_own_worker(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    base = consecutive_free_ports(3)  # decode, prefill, encode (dyn serve's order)
    d: DynProcess = dyn_serve(
        "--engine", "mocker", "--disagg", "--prefill-workers", "1", "--decode-workers", "1", "--encode-workers", "1",
        "--encode-min-kb", "0", "--max-local-prefill-length", "0", "--speedup-ratio", "10",
        "--engine-arg", "image_tokens=32", "--system-port", str(base),
    )  # fmt: skip
    d.system_ports = [base, base + 1, base + 2]  # type: ignore[attr-defined]
    for seed in (70, 71):
        reply, _ = ask(d, image_first(png_url(seed)))
        assert reply.choices[0].finish_reason == "length"
    assert frontend_metric(d, "remote") == 2
    assert worker_metric(d, 2, "images_encoded") == 2  # the encode worker
    assert worker_metric(d, 1, "image_embeds_received") == 2 and worker_metric(d, 1, "images_encoded") == 0  # prefill
    assert worker_metric(d, 0, "images_encoded") == 0  # decode: the prefilled KV holds the images
