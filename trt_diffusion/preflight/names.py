"""The checks' names, in the checklist's order (what --only / --skip take). Imports nothing: the CLI reads it."""

CHECK_NAMES = ("reproducibility", "buckets", "memory", "isolation", "cancellation", "plugins", "quality",
               "overload")
