"""The replay jobs: the code of replay that touches the database and processes.

``project`` reads finished episodes from the store, replays them with the pure core
(:mod:`workers.replay`) and writes their projection rows; ``parallel`` spreads that over a
process pool; ``sweep`` closes episodes whose worker died and projects what was never
projected. The Celery tasks (:mod:`workers.celery_tasks`) and ``trajstore replay``/``sweep`` call
these. Nothing is imported here, so that importing the package costs nothing.
"""

__all__: list[str] = []
