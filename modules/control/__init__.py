"""The control plane: rendezvous, membership and generations, heartbeats, the coordinator, store
keys, agreement."""
