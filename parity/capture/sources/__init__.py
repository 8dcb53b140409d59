"""Manifest sources: the capture paths that record bucket byte-offset manifests.

One module per source (fsdp2, graph, graph_makefx, eager_collectives), the protocol they share
(manifest_source), the pure FX walks the graph sources use (graph_walk, graph_fqns,
graph_passes), and the list the session installs (registry). docs/architecture.md, "Adding a
manifest source", shows what a new one touches. Nothing is imported here: importing a pure walk
must not import every source.
"""
