"""Orchestration: config, Ray resources, the driver loop, data, metrics, CLI."""
