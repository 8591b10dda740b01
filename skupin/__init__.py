"""The application layer: the `skupin` command line and the `run` pipeline. Nothing else imports this package."""
