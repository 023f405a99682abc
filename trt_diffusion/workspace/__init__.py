"""The workspace, on the ground floor: file mechanics (`files`), the content-addressed artifact store (`store`),
a URL workspace's remote store and stage sync (`remote_store`), locks (`locks`), folder engines' manifests
(`manifests`), provenance and the release manifest (`provenance`), and names read from files (`safe_paths`).
Nothing here imports a stage, a target or a model."""
