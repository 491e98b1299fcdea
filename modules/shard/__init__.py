"""Hierarchical replicas (issue 22): a stage held by a shard group of D devices with FSDP2."""
