"""The comparison helpers themselves: they must fail when they should, and say where."""

import pytest
import torch
from helpers import assert_close, assert_lowp_no_worse


def test_assert_close_reports_worst_elements():
    expected = torch.linspace(0, 1, 100, dtype=torch.float64)
    actual = expected.float().clone()
    actual[37] += 1e-2
    with pytest.raises(AssertionError, match=r"1/100 elements.*\n.*\n  at \(37,\)"):
        assert_close(actual, expected, name="x")
    assert_close(expected.float(), expected, name="x")


def test_assert_close_requires_matching_nan_positions():
    e = torch.tensor([1.0, float("nan")], dtype=torch.float64)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(torch.tensor([1.0, 2.0]), e, name="x")
    assert_close(torch.tensor([1.0, float("nan")]), e, name="x")


def test_lowp_check_fails_when_worse_than_twice_pytorch():
    oracle = torch.randn(1000, dtype=torch.float64)
    torch_bf16 = oracle.bfloat16()
    assert_lowp_no_worse(oracle.float(), torch_bf16, oracle, name="fp32 result")
    worse = oracle + 3 * (torch_bf16.double() - oracle).abs().max()
    with pytest.raises(AssertionError, match="exceeds 2.0 x"):
        assert_lowp_no_worse(worse, torch_bf16, oracle, name="bad")
