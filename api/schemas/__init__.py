"""Request and response schemas of the API, one module per resource (requests and responses
are separate classes)."""

__all__: list[str] = []
