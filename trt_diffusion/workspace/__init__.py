"""The workspace, on the ground floor: file mechanics (`files`), the content-addressed artifact store (`store`),
`build.workspace` values (`urls`), a URL workspace's remote store (`remote_store`) and what the stages call
around it (`store_sync`), locks (`locks`), folder engines' manifests
(`manifests`), provenance and the release manifest (`provenance`), and names read from files (`safe_paths`).
Nothing here imports a stage, a target or a model."""
