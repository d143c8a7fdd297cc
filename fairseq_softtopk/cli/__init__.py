"""The package's command-line entry points (console scripts declared in pyproject.toml)."""
