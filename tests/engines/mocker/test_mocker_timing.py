"""The polynomial timing model against the worked values of reference/dynamo.md §3.2."""

import pytest

from dynamo_cli.timing import TimingModel, decode_ms, prefill_ms


@pytest.mark.parametrize(
    ("num_tokens", "expected_ms"),
    [
        pytest.param(512, 24.4, id="512-tokens"),
        pytest.param(1024, 32.5, id="1024-tokens"),
        pytest.param(2048, 49.4, id="2048-tokens"),
        pytest.param(4096, 85.8, id="4096-tokens"),
        pytest.param(8192, 169.1, id="8192-tokens"),
    ],
)
def test_prefill_time_matches_dynamos_worked_values(num_tokens: int, expected_ms: float) -> None:
    assert prefill_ms(num_tokens) == pytest.approx(expected_ms, abs=0.05)


@pytest.mark.parametrize(
    ("kv_usage", "expected_ms"),
    [
        pytest.param(0.0, 5.74, id="empty-cache"),
        pytest.param(0.25, 17.6, id="quarter-full"),
        pytest.param(0.5, 26.3, id="half-full"),
        pytest.param(0.75, 31.8, id="three-quarters-full"),
        pytest.param(1.0, 34.0, id="full-cache"),
    ],
)
def test_decode_time_matches_dynamos_worked_values(kv_usage: float, expected_ms: float) -> None:
    assert decode_ms(kv_usage) == pytest.approx(expected_ms, abs=0.05)


def test_a_pass_adds_prefill_and_decode_and_divides_by_the_speedup_ratios() -> None:
    model = TimingModel(speedup_ratio=2.0, decode_speedup_ratio=4.0)
    expected = prefill_ms(1024) / 2.0 + decode_ms(0.5) / 8.0
    assert model.pass_ms(num_prefill_tokens=1024, num_decoding=3, kv_usage=0.5) == pytest.approx(expected)


def test_a_pass_without_prefill_pays_no_prefill_overhead() -> None:
    assert TimingModel().pass_ms(num_prefill_tokens=0, num_decoding=5, kv_usage=0.0) == pytest.approx(5.74)


def test_a_pass_that_emits_nothing_pays_no_decode_time() -> None:
    assert TimingModel().pass_ms(num_prefill_tokens=512, num_decoding=0, kv_usage=0.9) == pytest.approx(prefill_ms(512))


def test_an_idle_pass_takes_no_time() -> None:
    assert TimingModel().pass_ms(num_prefill_tokens=0, num_decoding=0, kv_usage=0.0) == 0.0
