"""Measurement: one configuration served under load (bench), its capacity within an SLO (capacity), the load
generator and workloads, per-request metrics, the host's other load, the decode roofline."""
