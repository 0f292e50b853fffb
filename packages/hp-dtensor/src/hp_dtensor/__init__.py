"""hp_dtensor: not implemented yet.

This package is reserved in the monorepo so its name, version and dependency
pins exist from the start; its features arrive with their own issue and
nothing here claims to work before then.
"""

from hp_dtensor.__about__ import __version__

__all__ = ["__version__"]
