"""The parity helpers themselves: a comparison that cannot fail would pass every parity test."""
import numpy as np
import pytest

from jaxhybrid.model.testing import assert_tree_close, max_rel_err


def test_a_missing_or_moved_leaf_is_never_agreement():
    one = np.ones(3, np.float32)
    for a, b in (({"a": one}, {"a": one, "b": 0 * one}), ([one], {"x": one})):
        with pytest.raises(ValueError, match="tree structures differ"):
            max_rel_err(a, b)
        with pytest.raises(AssertionError, match="tree structures differ"):
            assert_tree_close(a, b)


def test_errors_name_the_leaf_and_respect_the_tolerance():
    want = {"w": np.array([1.0, -2.0], np.float32)}
    near = {"w": np.array([1.0, -2.0 + 1e-5], np.float32)}
    assert max_rel_err(near, want) == pytest.approx(5e-6, rel=0.01)
    assert_tree_close(near, want, "fp32_parity")
    with pytest.raises(AssertionError, match=r"\['w'\]: relative error .* > tolerance 1.0e-06"):
        assert_tree_close(near, want, "fp32_kernel")
    with pytest.raises(AssertionError, match=r"\['w'\]: not bit-identical"):
        assert_tree_close(near, want, "exact")
    with pytest.raises(AssertionError, match=r"dtype float64 != expected float32"):
        assert_tree_close({"w": want["w"].astype(np.float64)}, want, "exact")
