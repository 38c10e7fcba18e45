"""A module imported at its first attribute read, not at the importer's import: Pallas's GPU backends, which only a
kernel's trace reads, cost every jaxtrain process 0.4 s (Mosaic GPU) and 0.14 s (Triton) of its start on a CPU.
(importlib's LazyLoader, tried first, failed to load its module wherever a test had imported the real one.)"""

import importlib


class ImportedOnFirstUse:
    """Attribute reads of the module `name`, imported (a plain import) at the first."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)
