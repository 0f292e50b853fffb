"""The installed distribution and the import agree on name and version."""

import importlib.metadata

import hp_dtensor


def test_version_matches_distribution_metadata() -> None:
    assert importlib.metadata.version("hp-dtensor") == hp_dtensor.__version__


def test_public_names_exist() -> None:
    missing = [name for name in hp_dtensor.__all__ if not hasattr(hp_dtensor, name)]
    assert missing == []
