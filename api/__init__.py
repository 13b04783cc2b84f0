"""The REST API of trajstore (FastAPI): ingest, trajectory queries, exports, batches over
HTTP, the capture gateway and the remote-rollout endpoints. The application is built by
``api.app.create_app``; ``trajstore.api_cli`` adds ``trajstore serve`` and ``trajstore keys``.
Nothing is imported here, so that the CLI stays cheap to load."""

__all__: list[str] = []
