"""Workload generators: exact lengths, exact prefix sharing, reproducible trace blocks."""

from __future__ import annotations

import itertools
import json

import pytest

from dynamo_cli.bench import workload as wl


def _shared(a: list, b: list) -> int:
    return sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1], zip(a, b, strict=False)))


@pytest.fixture(scope="module")
def vocab() -> wl.Vocab:
    return wl.approximate_vocab("approximate (test)")


@pytest.fixture(scope="module")
def model_vocab() -> wl.Vocab:
    vocab = wl.load_vocab("smollm2")
    if not vocab.is_exact:
        pytest.skip(f"no smollm2 tokenizer here: {vocab.source}")
    return vocab


def test_synthetic_prompts_have_the_asked_lengths_and_distinct_first_words(vocab: wl.Vocab) -> None:
    conversations = list(itertools.islice(wl.synthetic(vocab, 300, 50, 20, 5, seed=1), 200))
    lengths = [c.turns[0].input_tokens for c in conversations]
    assert all(len(c.turns[0].text.split()) == c.turns[0].input_tokens for c in conversations)
    assert 280 < sum(lengths) / len(lengths) < 320 and len(set(lengths)) > 20
    assert len({c.turns[0].text.split()[0] for c in conversations}) == 200


def test_shared_prefix_prompts_share_exactly_the_prefix_within_a_group_and_nothing_across(
    vocab: wl.Vocab,
) -> None:
    prompts = [c.turns[0].text.split() for c in itertools.islice(wl.shared_prefix(vocab, 3, 40, 25, 8, 0), 9)]
    assert all(len(p) == 65 for p in prompts)
    for i, j in itertools.combinations(range(9), 2):
        assert _shared(prompts[i], prompts[j]) == (40 if i % 3 == j % 3 else 0), (i, j)


def test_shared_prefix_is_exact_in_the_models_own_tokens(model_vocab: wl.Vocab) -> None:
    from dynamo_cli.model.paths import resolve_model_path
    from dynamo_cli.model.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path("smollm2"))
    ids = [tok.encode(c.turns[0].text) for c in itertools.islice(wl.shared_prefix(model_vocab, 2, 64, 32, 8, 0), 4)]
    assert [len(x) for x in ids] == [96] * 4
    assert (_shared(ids[0], ids[2]), _shared(ids[1], ids[3]), _shared(ids[0], ids[1])) == (64, 64, 0)


def test_synthetic_prompts_have_exactly_isl_model_tokens(model_vocab: wl.Vocab) -> None:
    for conversation in itertools.islice(wl.synthetic(model_vocab, 500, 100, 8, 0, seed=3), 5):
        turn = conversation.turns[0]
        assert model_vocab.count_tokens(turn.text) == turn.input_tokens


def test_equal_trace_hash_ids_give_equal_text_and_timestamps_are_scaled(tmp_path, vocab: wl.Vocab) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]},
        {"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [7, 10]},
        {"timestamp": 3000, "input_length": 512, "output_length": 5, "hash_ids": [8]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    entries = wl.read_trace(str(trace))
    convs = list(wl.trace_replay(vocab, entries, time_scale=0.5, block_size=512, seed=4))
    words = [c.turns[0].text.split() for c in convs]
    assert [len(w) for w in words] == [1100, 600, 512]
    assert words[0][:512] == words[1][:512]  # block 7 in both
    assert words[0][512:1024] == words[2]  # block 8
    assert words[0][1024:1100] != words[1][512:588]  # blocks 9 and 10 differ
    assert [c.at for c in convs] == [0.0, 0.25, 1.0]


def test_a_bad_trace_line_is_a_config_error_with_its_number(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}\nnot json\n')
    with pytest.raises(wl.ConfigError, match="line 2"):
        wl.read_trace(str(trace))


def test_a_prompts_file_accepts_plain_lines_and_jsonl(tmp_path, vocab: wl.Vocab) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text('hello there\n{"text": "from json"}\n\n')
    turns = [c.turns[0] for c in itertools.islice(wl.prompts_file(str(path), 10, 0, vocab), 3)]
    assert [t.text for t in turns] == ["hello there", "from json", "hello there"]
    assert [t.input_tokens for t in turns] == [2, 2, 2]


def test_images_repeat_the_asked_share_and_go_after_the_text(vocab: wl.Vocab) -> None:
    import base64
    import io

    from PIL import Image

    from dynamo_cli.bench.load import RequestBuilder

    maker = wl.ImageMaker(side=16, repeat=0.5, pool=3, seed=1)
    turns = [
        t for c in itertools.islice(wl.with_images(wl.synthetic(vocab, 8, 0, 4, 0), maker, 2), 200) for t in c.turns
    ]
    images = [u for t in turns for u in t.images]
    assert all(len(t.images) == 2 for t in turns) and len(images) == 400
    repeated = sum(u in maker.pool for u in images)
    assert 160 < repeated < 240 and len(set(images) - set(maker.pool)) == 400 - repeated  # the new ones are new
    raw = base64.b64decode(images[0].partition(",")[2])
    assert Image.open(io.BytesIO(raw)).size == (16, 16)
    body = RequestBuilder("m").body([], turns[0])
    content = body["messages"][0]["content"]
    assert content[0] == {"type": "text", "text": turns[0].text}
    assert [p["image_url"]["url"] for p in content[1:]] == list(turns[0].images)
    assert wl.ImageMaker(16, 0.5, 3, seed=1).pool == maker.pool  # reproducible
