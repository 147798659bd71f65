"""The floor under every stage: errors, files, object stores, records, manifests and wheels.

Nothing here imports release/, tasks/ or flows/; they all stand on it.
"""
