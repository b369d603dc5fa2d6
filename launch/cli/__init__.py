"""The ``strata`` command (``main``): ``generate``, ``serve``, ``bench``, ``launch ray``.
``python -m strata.launch.cli`` runs it too."""
