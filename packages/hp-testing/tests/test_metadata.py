"""The installed distribution and the import agree on name and version."""

import importlib.metadata

import hp_testing


def test_version_matches_distribution_metadata() -> None:
    assert importlib.metadata.version("hp-testing") == hp_testing.__version__


def test_public_names_exist() -> None:
    missing = [name for name in hp_testing.__all__ if not hasattr(hp_testing, name)]
    assert missing == []
