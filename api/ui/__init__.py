"""The read-only web page served at ``/ui`` (see :mod:`api.ui.routes`)."""
