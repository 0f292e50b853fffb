"""The installed distribution and the import agree on name and version."""

import importlib.metadata

import hp_fsdp


def test_version_matches_distribution_metadata() -> None:
    assert importlib.metadata.version("hp-fsdp") == hp_fsdp.__version__


def test_public_names_exist() -> None:
    missing = [name for name in hp_fsdp.__all__ if not hasattr(hp_fsdp, name)]
    assert missing == []
