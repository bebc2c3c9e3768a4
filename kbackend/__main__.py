from kbackend.cli import entrypoint

entrypoint()
