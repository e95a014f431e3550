"""The request core's output accumulator (core/output.py): what a stream has brought so far, across workers."""

from __future__ import annotations

import msgspec

from dynamo_cli.core.output import Output
from dynamo_cli.core.prefill import PrefillResult
from dynamo_cli.kv.handles import TransferReport
from dynamo_cli.wire import GenerateChunk, TokenLogprob

_encode = msgspec.msgpack.Encoder().encode


def raw(chunk: GenerateChunk) -> msgspec.Raw:
    return msgspec.Raw(_encode(chunk))


def test_batches_add_their_tokens_logprobs_and_the_first_cached_count_and_tell_of_transfers() -> None:
    transfers: list[TransferReport] = []
    output = Output(transfers.append)
    report = TransferReport(nbytes=4096, seconds=0.01, backend="tcp")
    lp = TokenLogprob(logprob=-0.5)
    assert output.absorb([raw(GenerateChunk(token_ids=[], num_cached_tokens=32))]) == []
    assert output.first_token_at is None  # no token yet
    seven = GenerateChunk(token_ids=[7], logprobs=[lp], transfer=report)
    ids = output.absorb([raw(seven), raw(GenerateChunk(token_ids=[8]))])
    first = output.first_token_at
    assert ids == [7, 8] and output.token_ids == [7, 8] and output.logprobs == [lp] and transfers == [report]
    output.absorb([raw(GenerateChunk(token_ids=[9], num_cached_tokens=0, finish_reason="length"))])
    assert output.token_ids == [7, 8, 9] and output.cached_tokens == 32  # the first worker's count stays
    assert output.finish_reason == "length" and output.first_token_at == first


def test_a_remote_prefills_first_token_is_the_first_and_encodes_as_one_chunk() -> None:
    output = Output(lambda report: None)
    output.took_prefill(PrefillResult(42, None, None, 16, worker_id=1))
    assert output.token_ids == [42] and output.first_token_at is not None
    chunk = msgspec.msgpack.decode(output.encoded(), type=GenerateChunk)
    assert (chunk.token_ids, chunk.num_cached_tokens, chunk.finish_reason) == ([42], 16, None)
