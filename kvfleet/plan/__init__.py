"""`kvfleet plan`: the capacity planner (KV bytes per token, what fits, cost per token)."""
