"""An endpoint of any name whose requests and replies are plain msgpack, for tests of the request plane itself (the
transport, discovery's serving, stalls): a handler gets the body as `msgspec.Raw` and yields encoded bytes."""

from __future__ import annotations

import msgspec

from dynamo_cli.wire import EndpointSpec


def raw(name: str) -> EndpointSpec[msgspec.Raw, msgspec.Raw]:
    return EndpointSpec(name, msgspec.Raw, msgspec.Raw)
