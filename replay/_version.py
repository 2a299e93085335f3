"""The version of replay, in one place: the package, ``replay --version``, the manifests the
recorder writes and pyproject (``[tool.setuptools.dynamic]``) all read it from here, so it is
right whether or not the package is pip-installed."""

__version__ = "0.1.0"
