"""The build stage: the engines engines.yaml asks for, built through the targets' protocol (targets/).

`stage.py` decides which engines this host builds and builds them (jobs under a memory budget, each under its
key's lock, provenance recorded, a URL workspace synced), `build_state.py` answers a no-op build from a stat
fingerprint, `shards.py` splits the matrix for CI (`build --shard I/N`), `ray_executor.py` builds on a Ray
cluster (`build --ray`), and `report.py` holds what a build reports (outcomes, failures as data, skipped
targets). Nothing in targets/ imports this package: a backend knows nothing of the stage that calls it.
"""
