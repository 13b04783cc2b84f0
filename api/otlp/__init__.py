"""OTLP/HTTP trace ingest: spans of agents instrumented with OpenTelemetry (GenAI semantic
conventions, OpenInference) stored as trajstore events. ``decode`` reads an export,
``genai`` maps its spans to events per episode, ``ingest`` stores them; the route is
``api.routers.traces``. See ``docs/otlp.md``."""
