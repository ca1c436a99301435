"""kvcm_client: wire models and errors of kvcm (the typed HTTP clients come with the service)."""

from . import errors, models

__all__ = ["errors", "models"]
