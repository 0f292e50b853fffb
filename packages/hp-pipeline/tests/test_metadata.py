"""The installed distribution and the import agree on name and version."""

import importlib.metadata

import hp_pipeline


def test_version_matches_distribution_metadata() -> None:
    assert importlib.metadata.version("hp-pipeline") == hp_pipeline.__version__


def test_public_names_exist() -> None:
    missing = [name for name in hp_pipeline.__all__ if not hasattr(hp_pipeline, name)]
    assert missing == []
