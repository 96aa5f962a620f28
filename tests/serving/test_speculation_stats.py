"""Adaptive speculation's choices and estimates in /metrics and in a response's ``dflash`` statistics."""

from dflash_jax.runtime.batcher import GenerationResult
from dflash_jax.runtime.speculation import Choice
from dflash_jax.serving.app import _stats
from dflash_jax.serving.metrics import Metrics


def _result(block_steps):
    return GenerationResult(output_ids=[1, 2, 3, 4], acceptance_lengths=[2, 1], num_prompt_tokens=3,
                            finish_reason="length", time_to_first_token=0.1, time_per_output_token=0.01,
                            num_steps=2, block_steps=block_steps, acceptance_rate=None if block_steps is None else 0.4)


def test_metrics_show_the_choices_and_the_models_estimates():
    metrics = Metrics()
    assert "dflash_speculation" not in metrics.render("m")  # a fixed engine: no such series
    metrics.request_done(_result({8: 1, 1: 1}), 0.0)
    metrics.speculation_choice(Choice(8, {8: 120.0, 1: 100.0}, {8: 2.4, 1: 1.0}, 0.45))
    metrics.speculation_choice(Choice(1, {8: 90.0, 1: 100.0}, {8: 1.8, 1: 1.0}, 0.3))
    text = metrics.render("m")
    assert 'dflash_speculation_calls_total{model="m",block="1"} 1' in text
    assert 'dflash_speculation_calls_total{model="m",block="8"} 1' in text
    assert 'dflash_speculation_steps_total{model="m",block="8"} 1' in text
    assert 'dflash_speculation_block{model="m"} 1' in text
    assert 'dflash_speculation_acceptance_rate{model="m"} 0.3' in text
    assert 'dflash_speculation_expected_tokens_per_second{model="m",block="8"} 90' in text


def test_response_stats_carry_the_blocks_run_only_when_adaptive():
    assert "block_steps" not in _stats(0, _result(None))
    stats = _stats(0, _result({8: 1, 1: 1}))
    assert stats["block_steps"] == {"8": 1, "1": 1} and stats["acceptance_rate"] == 0.4
