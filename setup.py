"""For tools and users that still run ``setup.py``: the metadata lives in pyproject.toml alone."""

from setuptools import setup

setup()
