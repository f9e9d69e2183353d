"""Cache-aware load balancing across data-parallel replicas."""
