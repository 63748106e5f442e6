"""`kvfleet bench`: replays a request trace against a running OpenAI-compatible server and reports
latency, throughput, cost and SLO goodput."""
