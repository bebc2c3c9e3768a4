"""Multi-process plumbing: ``child`` runs a function under a chosen Keras backend in a child."""
