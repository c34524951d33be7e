"""The messages both ends of a refit exchange: typed, JSON-able, never unpickled (``protocol``,
``faults``), and slices stored by digest (``slice_store``). Metadata only: no torch."""
