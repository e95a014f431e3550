"""Typed endpoints (wire.EndpointSpec on the request plane): the server decodes a request once and encodes the
handler's replies, the client encodes once and decodes each reply; a body that is not the endpoint's request is the
caller's 400 and never reaches the handler, and a reply that is not the endpoint's is the server's fault."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest

from dynamo_cli.errors import RemoteError
from dynamo_cli.runtime.request_client import RequestClient
from dynamo_cli.runtime.transport import RequestServer
from dynamo_cli.wire import KV_RELEASE, LORA, EndpointSpec, KvRelease, LoraCommand, LoraReply

TAKEN: list[object] = []


async def release(request: KvRelease) -> AsyncIterator[bool]:
    TAKEN.append(request)
    yield request.transfer_id == "t-1"


async def silent(request: LoraCommand) -> AsyncIterator[LoraReply]:
    return
    yield  # an async generator that yields nothing


async def liar(request: msgspec.Raw) -> AsyncIterator[bytes]:
    yield msgspec.msgpack.encode({"not": "a LoraReply"})


@pytest.fixture
async def client() -> AsyncIterator[RequestClient]:
    server = RequestServer()
    server.add_endpoint(KV_RELEASE, release)
    server.add_endpoint(LORA, silent)
    server.add_endpoint(EndpointSpec("lying_lora", msgspec.Raw, msgspec.Raw), liar)
    client = RequestClient(await server.start())
    TAKEN.clear()
    yield client
    await client.close()
    await server.close()


async def test_a_typed_call_round_trips_the_request_and_its_reply(client: RequestClient) -> None:
    assert await client.call(KV_RELEASE, KvRelease(transfer_id="t-1")) is True
    assert await client.call(KV_RELEASE, KvRelease(transfer_id="t-2")) is False
    assert TAKEN == [KvRelease(transfer_id="t-1"), KvRelease(transfer_id="t-2")]


async def test_a_body_that_is_not_the_request_is_the_callers_400_and_never_reaches_the_handler(
    client: RequestClient,
) -> None:
    stream = await client.open_stream(KV_RELEASE.name, msgspec.msgpack.encode({"transfer": 7}))
    with pytest.raises(RemoteError, match=r"malformed kv_release request \(KvRelease\)") as refused:
        await stream.next_batch()
    assert refused.value.status == 400 and refused.value.is_client_error and TAKEN == []
    assert await client.call(KV_RELEASE, KvRelease(transfer_id="t-1"))  # the connection still serves


async def test_no_reply_or_a_reply_of_another_type_is_the_servers_fault(client: RequestClient) -> None:
    with pytest.raises(RemoteError, match="sent no lora reply") as none:
        await client.call(LORA, LoraCommand(action="load", name="a", path="/x"))
    lying = EndpointSpec("lying_lora", LoraCommand, LoraReply)
    with pytest.raises(RemoteError, match=r"malformed lying_lora reply \(LoraReply\)") as malformed:
        await client.call(lying, LoraCommand(action="load", name="a", path="/x"))
    assert none.value.status == malformed.value.status == 502
    assert not none.value.is_client_error and not malformed.value.is_client_error
