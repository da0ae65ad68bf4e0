"""Root of the test tree: pytest puts this directory on ``sys.path``, so the shared helpers
here (``_isolated``) import from every suite."""
