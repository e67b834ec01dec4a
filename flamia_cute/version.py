"""The package version: part of the tuned records' key (a new version ignores records of an old one)."""

__version__ = "0.2.0"
