"""Serving: load a model for inference, export it across backends, and answer HTTP requests."""
