"""The gateway's side of the fleet: the engine client interface the handlers talk to, and its Redis
implementation (enqueue, the one pub/sub fan-out, snapshots, queue load)."""
