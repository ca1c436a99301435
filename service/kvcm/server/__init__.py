"""The sidecar service: FastAPI app, settings, leases and metrics around one manager."""
