"""Fixtures shared by the engine tests of this package."""

import pytest

from copycat_fixtures import shallow_copycat_pair
from dflash_jax import load_drafter, load_target


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny pair with varied acceptance lengths without training (``write_copycat_pair``, over a 2-layer
    target: ``copycat_fixtures``), block 8, built once per test module."""
    target_dir, drafter_dir = shallow_copycat_pair(tmp_path_factory.mktemp("copycat"), block_size=8)
    return load_target(target_dir), load_drafter(drafter_dir)
