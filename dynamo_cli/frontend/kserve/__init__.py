"""The KServe v2 inference protocol over gRPC (`--kserve-grpc-port`), as Triton's clients speak it: an LLM served
as tensors `text_input` -> `text_output`, on the same gate and request lifecycle as the HTTP APIs.

    proto.py   the protocol's messages, built at import from a table of the published fields (no generated code)
    tensors.py a request's tensors and parameters read and checked; the reply's tensors written (pure)
    api.py     ModelInfer / ModelStreamInfer as an `Api` of the edge's one lifecycle (a completion underneath)
    server.py  the grpc.aio server: its RPCs, TLS, the API-key gate, HTTP errors as gRPC statuses
"""

from __future__ import annotations

from dynamo_cli.config import FrontendConfig
from dynamo_cli.errors import ConfigError

INSTALL = "pip install 'dynamo-cli[kserve]'"


def check_kserve(config: FrontendConfig) -> None:
    """Fail now, with one ConfigError, where `--kserve-grpc-port` is set and grpcio does not import."""
    if config.kserve_grpc_port is None:
        return
    try:
        import google.protobuf  # noqa: F401
        import grpc  # noqa: F401
    except ImportError as exc:
        missing = exc.name
        raise ConfigError(
            f"--kserve-grpc-port needs grpcio and protobuf ({missing} does not import); {INSTALL}"
        ) from None
