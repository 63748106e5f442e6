"""What operators see: Prometheus metrics of the gateway and the live fleet dashboard."""
