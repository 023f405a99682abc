"""The pre-launch checklist's vocabulary: its checks' names, in the order they run (what `--only`/`--skip` and
engines.yaml's `preflight.skip` take). Ground floor and import-free, like `families`: the engines.yaml schema,
`preflight/` and the CLI (at start, for its help) all read it."""

CHECK_NAMES = ("reproducibility", "buckets", "memory", "isolation", "cancellation", "plugins", "quality",
               "overload")
