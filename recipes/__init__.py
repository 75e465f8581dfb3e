"""Training recipes (YAML) and launcher configs shipped as package data."""
