"""``Policy.load(root).act(obs)``: the manifest's contract, clamping and the NaN guard."""

from __future__ import annotations

import numpy as np
import pytest

from edge.policy import Policy
from tests.bundles import active_store


@pytest.fixture()
def root(tmp_path):
    return active_store(tmp_path)


def test_act_clamps_to_manifest_limits(root):
    policy = Policy.load(root)
    assert policy.act(np.full(5, 10.0)) == pytest.approx([0.8])  # graph gives 1.0, manifest caps at 0.8
    assert policy.act(np.full(5, -10.0)) == pytest.approx([-0.5])
    batch = policy.act(np.zeros((3, 5)))
    assert batch.shape == (3, 1) and np.allclose(batch, 0.0)


def test_the_runtime_is_chosen_and_reported(root):
    policy = Policy.load(root)
    description = policy.runtime_description
    assert description.startswith("onnxruntime (CPUExecutionProvider)"), description
    try:
        import tensorrt  # noqa: F401
    except ImportError:  # this machine: TensorRT was tried first and the reason it was passed over is given
        assert "skipped tensorrt:" in description, description


def test_nan_observation_gives_default_action_and_is_counted(root):
    policy = Policy.load(root)
    obs = np.zeros((2, 5))
    obs[1, 2] = np.nan
    out = policy.act(obs)
    assert out[0, 0] == 0.0 and out[1, 0] == pytest.approx(0.1)
    assert policy.unsafe_count == 1


def test_wrong_observation_layout_is_refused(root):
    policy = Policy.load(root)
    with pytest.raises(ValueError, match="expects 5"):
        policy.act(np.zeros(4))
    with pytest.raises(ValueError, match="do not match"):
        policy.check_names(["a", "b", "c", "e", "d"])


def test_load_without_active_policy(tmp_path):
    with pytest.raises(FileNotFoundError, match="no active policy"):
        Policy.load(tmp_path)
