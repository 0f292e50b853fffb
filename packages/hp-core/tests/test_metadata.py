"""The installed distribution and the import agree on name and version."""

import importlib.metadata

import hp_core


def test_version_matches_distribution_metadata() -> None:
    assert importlib.metadata.version("hp-core") == hp_core.__version__


def test_public_names_exist() -> None:
    missing = [name for name in hp_core.__all__ if not hasattr(hp_core, name)]
    assert missing == []
