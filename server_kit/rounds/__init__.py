"""A training round's parts that every driver and every ingest worker share.

- :mod:`.admission`: :func:`~.admission.admit_update`, the one set of checks of
  a round's update (or of a worker's receipt of one), with one set of reasons.
"""
